// Megatron's weight-hash check across data-parallel replicas (see train.h,
// param_hash_mismatches): every rank hashes the model params as the forward reads them and the
// ranks compare. Replicas drift apart silently (a bit flip, a rank that skipped an update, a
// non-deterministic kernel) and the loss shows it only much later, if at all.
#include <zlib.h>

#include <mxddp/train.h>

namespace mxddp {

namespace {

// CRC-32 (zlib's) of a view's bytes, in chunks that fit zlib's uInt length.
uint32_t crc32_update(uint32_t crc, const TensorView& v) {
  const auto* bytes = static_cast<const Bytef*>(v.data);
  size_t left = v.nbytes();
  while (left > 0) {
    const auto chunk = static_cast<uInt>(std::min<size_t>(left, size_t{1} << 30));
    crc = static_cast<uint32_t>(::crc32(crc, bytes, chunk));
    bytes += chunk;
    left -= chunk;
  }
  return crc;
}

// The param as the forward reads it: its values, or an MXFP8 param's row-wise payload and scales.
// (The column-wise copy is quantized from the same values in the same step, DDP's from the same
// gathered tensor and FSDP's from the same staged shard and all-reduced scales; FSDP holds it only
// in backward, so a forward-only pass cannot read it.)
uint32_t param_hash(const DataParallel& dp, int index) {
  const uint32_t crc = static_cast<uint32_t>(::crc32(0L, Z_NULL, 0));
  if (!dp.is_mxfp8(index)) return crc32_update(crc, dp.param(index));
  const Mxfp8View t = dp.mxfp8_param(index, QuantAxis::kRow);
  return crc32_update(crc32_update(crc, t.data), t.scales);
}

}  // namespace

std::string param_hash_mismatches(DataParallel& dp, const std::vector<std::vector<int>>& modules) {
  Communicator& comm = dp.communicator();
  const int n = dp.num_params(), ranks = comm.size();
  std::vector<uint32_t> mine(static_cast<size_t>(n), 0);  // [num_params]
  std::vector<bool> seen(static_cast<size_t>(n), false);
  // Each module between its pre- and post-forward hook, as a forward-only pass reads it: DDP's
  // params are resident, FSDP gathers a unit's and releases it after.
  for (const std::vector<int>& module : modules) {
    dp.before_forward(module);
    for (int p : module) {
      MXDDP_CHECK(p >= 0 && p < n, "param index {} in a module is out of range; valid: 0..{}", p, n - 1);
      mine[static_cast<size_t>(p)] = param_hash(dp, p);
      seen[static_cast<size_t>(p)] = true;
    }
    dp.after_forward(module);
  }
  dp.release_gathered_params();
  for (int p = 0; p < n; ++p)
    MXDDP_CHECK(seen[static_cast<size_t>(p)], "param '{}' is in no module: the weight-hash check would skip it",
                dp.params()[static_cast<size_t>(p)].name);

  std::vector<uint32_t> all(static_cast<size_t>(n) * ranks);  // [ranks, num_params]
  const auto bytes = static_cast<int64_t>(n) * 4;
  comm.all_gather(TensorView{mine.data(), DType::kU8, Shape{bytes}, Device::cpu()},
                  TensorView{all.data(), DType::kU8, Shape{bytes * ranks}, Device::cpu()});

  // Every rank sees every hash, so every rank reaches the same verdict and the same message.
  std::string report;
  int mismatched = 0;
  constexpr int kParamsNamedMax = 16;
  for (int p = 0; p < n; ++p) {
    std::string ranks_differing;
    for (int r = 1; r < ranks; ++r)
      if (all[static_cast<size_t>(r) * n + p] != all[static_cast<size_t>(p)])
        ranks_differing += fmt::format("{}{}", ranks_differing.empty() ? "" : ", ", r);
    if (ranks_differing.empty()) continue;
    if (++mismatched <= kParamsNamedMax)
      report += fmt::format("{}'{}' (ranks {} differ from rank 0)", report.empty() ? "" : "; ",
                            dp.params()[static_cast<size_t>(p)].name, ranks_differing);
  }
  if (mismatched > kParamsNamedMax) report += fmt::format("; and {} more params", mismatched - kParamsNamedMax);
  return report;
}

}  // namespace mxddp
