#!/usr/bin/python3
"""mxddp's indexed-dataset reader against files megatron-core itself writes (optional: skipped,
exit 77, where the Python running it has no megatron-core; CI does not need it).

megatron-core's IndexedDatasetBuilder writes two datasets (uint16 and int32 tokens, two
sequences per document); megatron-core's IndexedDataset reads them back, and megatron-core's split
matrix for --split 90,8,2, rounded over the documents as megatron-core rounds it, gives the
training split. The unigram entropy of that
split's tokens, computed here from megatron-core's reading, must equal what `mxddp train` prints
for the same files: the same tokens, documents, and split boundaries.

    megatron_core_check.py MXDDP_BINARY WORK_DIR
"""
import math
import os
import re
import subprocess
import sys

try:
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)
except ImportError as e:
    print(f"SKIP: no megatron-core here ({e})")
    sys.exit(77)

mxddp, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
train_bookends = convert_split_vector_to_split_matrix(parse_and_normalize_split("90,8,2"))[0]
for dtype, vocab in ((numpy.uint16, 50257), (numpy.int32, 100000)):
    prefix = os.path.join(work, f"mcore_{numpy.dtype(dtype).name}")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    rng = numpy.random.default_rng(1)
    for _ in range(150):
        n = int(rng.integers(10, 90))
        # Zipf-like ids, so the entropy depends on which documents are counted.
        ids = numpy.minimum(rng.zipf(1.3, n), vocab) - 1
        builder.add_document(torch.from_numpy(ids.astype(numpy.int64)), [n // 3, n - n // 3])
    builder.finalize(prefix + ".idx")
    data = IndexedDataset(prefix)
    documents = data.document_indices.shape[0] - 1
    bounds = [int(round(b * float(documents))) for b in train_bookends]
    counts = {}
    for d in range(bounds[0], bounds[1]):
        for s in range(data.document_indices[d], data.document_indices[d + 1]):
            for t in data[s].tolist():
                counts[t] = counts.get(t, 0) + 1
    total = sum(counts.values())
    entropy = -sum(c / total * math.log(c / total) for c in counts.values())
    out = subprocess.run([mxddp, "train", "--ranks", "1", "--data-path", prefix, "--vocab-size", str(vocab),
                          "--split", "90,8,2", "--train-iters", "1", "--eval-iters", "1", "--seq-length", "16",
                          "--micro-batch-size", "1", "--global-batch-size", "1"],
                         capture_output=True, text=True)
    m = re.search(r"unigram entropy of the data ([0-9.]+) nats", out.stdout)
    if out.returncode != 0 or not m:
        sys.exit(f"mxddp train failed on {prefix}: {out.stdout[-2000:]} {out.stderr[-2000:]}")
    if abs(float(m.group(1)) - entropy) > 1e-4:
        sys.exit(f"{prefix}: mxddp's training split has entropy {m.group(1)}, megatron-core's {entropy:.4f}")
    print(f"{numpy.dtype(dtype).name}: {len(data)} sequences, {documents} documents, train split {bounds[:2]}, "
          f"entropy {entropy:.4f} both")
print("megatron-core's files read alike")
