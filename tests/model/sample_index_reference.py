#!/usr/bin/python3
"""An independent Python reference of mxddp's GPT sample index (docs/data.md, Samples): it reads
the .bin/.idx files itself, splits the documents as megatron-core does, shuffles each epoch's
documents and windows with SplitMix64 as the page says, blends by Megatron's greedy rule, and
compares every sample with what `mxddp data` prints, for the training and validation splits,
over several epochs.

    sample_index_reference.py MXDDP_BINARY SEQ_LENGTH SEED SPLIT W1 PREFIX1 [W2 PREFIX2 ...]
"""
import json
import struct
import subprocess
import sys

MASK = (1 << 64) - 1
DTYPES = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 8: "H"}


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def mix_hash(a, b, c=0):
    return splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)


def shuffled(items, seed):
    items, state = list(items), seed
    for i in range(len(items), 1, -1):
        j = splitmix64(state) % i
        state = (state + 1) & MASK
        items[i - 1], items[j] = items[j], items[i - 1]
    return items


def read_documents(prefix):
    idx = open(prefix + ".idx", "rb").read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    code = idx[17]
    seqs, docs = struct.unpack_from("<QQ", idx, 18)
    lengths = struct.unpack_from(f"<{seqs}i", idx, 34)
    pointers = struct.unpack_from(f"<{seqs}q", idx, 34 + 4 * seqs)
    doc_index = struct.unpack_from(f"<{docs}q", idx, 34 + 12 * seqs)
    binary = open(prefix + ".bin", "rb").read()
    width = struct.calcsize(DTYPES[code])
    sequences = [list(struct.unpack_from(f"<{n}{DTYPES[code]}", binary, p)) for n, p in zip(lengths, pointers)]
    assert all(p % width == 0 for p in pointers)
    return [sum(sequences[doc_index[d]:doc_index[d + 1]], []) for d in range(docs - 1)]


class SplitIndex:
    def __init__(self, documents, first, last, seq, seed):
        self.documents, self.first, self.last, self.seq, self.seed = documents, first, last, seq, seed
        self.tokens = sum(len(documents[d]) for d in range(first, last))
        self.per_epoch = (self.tokens - 1) // seq
        self.epochs = {}

    def sample(self, s):
        e = s // self.per_epoch
        if e not in self.epochs:
            order = shuffled(range(self.first, self.last), mix_hash(self.seed, 0x646F63756D656E74, e))
            windows = shuffled(range(self.per_epoch), mix_hash(self.seed, 0x77696E646F77, e))
            self.epochs[e] = (sum((self.documents[d] for d in order), []), windows)
        tokens, windows = self.epochs[e]
        start = windows[s % self.per_epoch] * self.seq
        return tokens[start:start + self.seq + 1]


def main():
    mxddp, seq, seed, split_text = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    pairs = sys.argv[5:]
    weights = [float(w) for w in pairs[0::2]]
    weights = [w / sum(weights) for w in weights]
    split = [float(x) for x in split_text.split(",")]
    split = [x / sum(split) for x in split]
    indexes = []
    for k, prefix in enumerate(pairs[1::2]):
        docs = read_documents(prefix)
        n = len(docs)
        bounds = [0, round(split[0] * n), round((split[0] + split[1]) * n), n]
        indexes.append([SplitIndex(docs, bounds[s], bounds[s + 1], seq, mix_hash(seed, k, s)) for s in (0, 1)])
    checked = 0
    for s, name in ((0, "train"), (1, "valid")):
        count = 3 * min(ix[s].per_epoch for ix in indexes) + 5  # past several epochs of every dataset
        taken, expected = [0] * len(indexes), []
        for i in range(count):  # Megatron's greedy blend
            x = max(i, 1)
            errors = [w * x - t for w, t in zip(weights, taken)]
            k = errors.index(max(errors))
            expected.append(indexes[k][s].sample(taken[k]))
            taken[k] += 1
        out = subprocess.run([mxddp, "data", "--data-path", *pairs, "--split", split_text, "--seq-length", str(seq),
                              "--seed", str(seed), "--split-name", name, "--count", str(count), "--vocab-size", "65536"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"mxddp data failed: {out.stderr}")
        got = json.loads(out.stdout)["samples"]
        for i, (a, b) in enumerate(zip(expected, got)):
            if a != b:
                sys.exit(f"{name} sample {i}: the reference reads {a}, mxddp {b}")
        if len(got) != count:
            sys.exit(f"{name}: {len(got)} samples printed, {count} asked for")
        checked += count
    print(f"sample index equals the reference: {checked} samples")


if __name__ == "__main__":
    main()
