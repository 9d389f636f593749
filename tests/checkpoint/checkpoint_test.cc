// Checkpoints: resharding round trips across dp and bucket sizes continue an uninterrupted run,
// same-dp resume is bitwise, every kind of damage is a clear error that changes nothing, writes
// are atomic, and inspect reports what a checkpoint holds.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <mxddp/checkpoint.h>
#include <mxddp/model.h>
#include <mxddp/train.h>

#include "checkpoint/file_io.h"
#include "checkpoint/safetensors.h"
#include "optim/optim_checks.h"

namespace mxddp::testing {
namespace {

namespace fs = std::filesystem;

const OptimizerConfig kAdam{.lr = 1e-2f, .weight_decay = 0.05f, .clip_grad = 1.0f};

std::string fresh_dir(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("mxddp_ckpt_{}_{}", name, ::getpid());
  fs::remove_all(dir);
  fs::remove_all(dir.string() + ".partial");
  return dir.string();
}

DdpConfig with_bucket(int64_t bucket_size) {
  DdpConfig c = optim_ddp_config();
  c.bucket_size = bucket_size;
  return c;
}

// Trains steps [first, last) at this dp, loading `load_from` first and saving to `save_to` after
// (either may be empty). Returns the losses (the same on every rank).
std::vector<double> run_segment(int dp, int64_t bucket_size, int first, int last, const std::string& load_from,
                                const std::string& save_to, const OptimizerConfig& cfg = kAdam) {
  std::vector<double> losses;
  run_local(dp, [&](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), with_bucket(bucket_size), tracker, views_of(init));
    DistributedOptimizer opt(ddp, cfg, tracker);
    if (!load_from.empty()) {
      const auto meta = load_checkpoint(load_from, opt);
      EXPECT_EQ(opt.step_count(), first);
      EXPECT_EQ(meta.at("next_step"), std::to_string(first));
    }
    std::vector<double> mine;
    for (int s = first; s < last; ++s) mine.push_back(ddp_train_step(opt, s, kGlobalBatch));
    if (!save_to.empty()) save_checkpoint(save_to, opt, {.metadata = {{"next_step", std::to_string(last)}}});
    if (comm.rank() == 0) losses = mine;
  });
  return losses;
}

TEST(Checkpoint, ReshardingRoundTripContinuesTheUninterruptedRun) {
  const std::vector<double> uninterrupted = run_segment(4, 128, 0, 8, "", "");
  const std::string a = fresh_dir("a"), b = fresh_dir("b"), c = fresh_dir("c");
  std::vector<double> resumed = run_segment(4, 128, 0, 2, "", a);
  for (double l : run_segment(2, 64, 2, 4, a, b)) resumed.push_back(l);
  for (double l : run_segment(1, 1000, 4, 6, b, c)) resumed.push_back(l);
  for (double l : run_segment(3, 200, 6, 8, c, "")) resumed.push_back(l);
  ASSERT_EQ(resumed.size(), uninterrupted.size());
  for (size_t s = 0; s < resumed.size(); ++s)
    EXPECT_NEAR(resumed[s], uninterrupted[s], 1e-5 * std::fabs(uninterrupted[s])) << "step " << s;
  EXPECT_LT(uninterrupted.back(), uninterrupted.front()) << "the run should learn something";
  for (const auto& d : {a, b, c}) fs::remove_all(d);
}

TEST(Checkpoint, SameDpResumeIsBitwise) {
  for (const char* optimizer : {"adam", "sgd"}) {
    OptimizerConfig cfg = kAdam;
    cfg.optimizer = parse_optimizer(optimizer);
    const std::string dir = fresh_dir(std::string("same_") + optimizer);
    const std::vector<double> uninterrupted = run_segment(2, 128, 0, 6, "", "", cfg);
    run_segment(2, 128, 0, 3, "", dir, cfg);
    const std::vector<double> resumed = run_segment(2, 128, 3, 6, dir, "", cfg);
    for (size_t s = 0; s < resumed.size(); ++s) EXPECT_EQ(resumed[s], uninterrupted[s + 3]) << optimizer << " step " << s + 3;
    fs::remove_all(dir);
  }
}

// Trains 2 steps at dp 2, then tries to load `dir` (prepared by `damage`) and checks that every
// rank throws an error containing `needle` and that nothing changed.
void expect_load_fails_and_changes_nothing(const std::string& dir, const std::string& needle,
                                           const std::vector<ParamSpec>& params = mlp_params(),
                                           const LoadOptions& options = {}) {
  run_local(2, [&](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    std::vector<TensorView> init_views;
    if (params.size() == mlp_params().size()) init_views = views_of(init);
    DistributedDataParallel ddp(comm, params, optim_ddp_config(), tracker, init_views);
    DistributedOptimizer opt(ddp, kAdam, tracker);
    if (params.size() == mlp_params().size()) {
      ddp_train_step(opt, 0, kGlobalBatch);
      ddp_train_step(opt, 1, kGlobalBatch);
    }
    auto snapshot = [&] {
      std::vector<float> s;
      for (size_t b = 0; b < ddp.buffer().layout().buckets.size(); ++b)
        for (const TensorView& v : {opt.main_params(static_cast<int>(b)), opt.state(0, static_cast<int>(b))})
          s.insert(s.end(), v.data_as<float>(), v.data_as<float>() + v.numel());
      const TensorView p = ddp.buffer().param_buffer();
      s.insert(s.end(), reinterpret_cast<const float*>(p.data), reinterpret_cast<const float*>(p.data) + p.nbytes() / 4);
      return s;
    };
    const auto before = snapshot();
    const int64_t step_before = opt.step_count();
    try {
      load_checkpoint(dir, opt, options);
      ADD_FAILURE() << "rank " << comm.rank() << ": the load succeeded; expected an error with '" << needle << "'";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find(needle) != std::string::npos || what.find("failed on rank") != std::string::npos)
          << "rank " << comm.rank() << ": " << what;
    }
    EXPECT_EQ(snapshot(), before) << "a failed load changed the run on rank " << comm.rank();
    EXPECT_EQ(opt.step_count(), step_before);
    ddp_train_step(opt, 2, kGlobalBatch);  // the run goes on
  });
}

// One step of the MLP at dp 2, then a save to dir with options.
void save_after_one_step(const std::string& dir, const SaveOptions& options) {
  run_local(2, [&](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker, views_of(init));
    DistributedOptimizer opt(ddp, kAdam, tracker);
    ddp_train_step(opt, 0, kGlobalBatch);
    save_checkpoint(dir, opt, options);
  });
}

std::string saved_checkpoint(const std::string& name) {
  const std::string dir = fresh_dir(name);
  run_segment(4, 128, 0, 3, "", dir);
  return dir;
}

void flip_byte(const std::string& path, std::streamoff from_end) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-from_end, std::ios::end);
  char c;
  f.get(c);
  f.seekp(-from_end, std::ios::end);
  f.put(static_cast<char>(c ^ 0x40));
}

TEST(Checkpoint, CorruptedShardIsDetected) {
  const std::string dir = saved_checkpoint("corrupt");
  flip_byte(dir + "/rank_00002.safetensors", 7);
  expect_load_fails_and_changes_nothing(dir, "is corrupted: CRC-32");
  const CheckpointInfo info = inspect_checkpoint(dir);
  EXPECT_FALSE(info.ok());
  EXPECT_NE(info.files[2].status.find("is corrupted"), std::string::npos) << info.files[2].status;
  EXPECT_EQ(info.files[0].status, "ok");
  fs::remove_all(dir);
}

TEST(Checkpoint, TruncatedAndMissingFilesAreDetected) {
  const std::string dir = saved_checkpoint("trunc");
  fs::resize_file(dir + "/rank_00001.safetensors", fs::file_size(dir + "/rank_00001.safetensors") - 100);
  expect_load_fails_and_changes_nothing(dir, "truncated or replaced");
  fs::remove(dir + "/rank_00001.safetensors");
  expect_load_fails_and_changes_nothing(dir, "is missing");
  fs::remove(dir + "/manifest.json");
  expect_load_fails_and_changes_nothing(dir, "no manifest.json");
  fs::remove_all(dir);
}

TEST(Checkpoint, ParamListMismatchIsAnError) {
  const std::string dir = saved_checkpoint("mismatch");
  std::vector<ParamSpec> other = mlp_params();
  other[2].name = "l1.weight";
  expect_load_fails_and_changes_nothing(dir, "param 2 of", other);
  fs::remove_all(dir);
}

TEST(Checkpoint, OptimizerMismatchIsAnError) {
  const std::string dir = fresh_dir("optmismatch");
  OptimizerConfig sgd = kAdam;
  sgd.optimizer = OptimizerType::kSgd;
  run_segment(2, 128, 0, 1, "", dir, sgd);
  expect_load_fails_and_changes_nothing(dir, "was saved by optimizer 'sgd' with state [momentum_buffer]; this optimizer is 'adam' with state [exp_avg, exp_avg_sq]");
  fs::remove_all(dir);
}

TEST(Checkpoint, SaveIsAtomicAndRefusesToOverwriteUnlessAsked) {
  const std::string dir = saved_checkpoint("atomic");
  EXPECT_FALSE(fs::exists(dir + ".partial")) << "the staging directory must be renamed into place";
  for (const auto& entry : fs::directory_iterator(dir))
    EXPECT_NE(entry.path().filename().string()[0], '.') << "temporary file left: " << entry.path();
  EXPECT_THROW(run_segment(2, 128, 0, 1, "", dir), Error);  // exists, no overwrite
  EXPECT_EQ(inspect_checkpoint(dir).step, 3) << "a refused save must leave the old checkpoint";
  save_after_one_step(dir, {.overwrite = true});
  const CheckpointInfo info = inspect_checkpoint(dir);
  EXPECT_EQ(info.step, 1);
  EXPECT_EQ(info.saved_dp, 2);
  EXPECT_TRUE(info.ok());
  EXPECT_EQ(info.params.size(), mlp_params().size());
  EXPECT_EQ(info.optimizer, "adam");
  fs::remove_all(dir);
}

// When one rank's part of a save fails, every rank's error carries that rank's message: a
// launcher may show any rank's error (whichever the local backend rethrows first, or mpirun's
// first failing process), and "see its error" pointed at a message the user might never see.
TEST(Checkpoint, EveryRankReportsTheFailingRanksError) {
  const std::string parent = fresh_dir("not_a_dir");
  { std::ofstream(parent) << "a regular file where the save's parent directory should be"; }
  std::vector<std::string> errors(4);
  run_local(4, [&](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker, views_of(init));
    DistributedOptimizer opt(ddp, kAdam, tracker);
    try {
      save_checkpoint(parent + "/ck", opt);
    } catch (const std::exception& e) {
      errors[static_cast<size_t>(comm.rank())] = e.what();
    }
  });
  fs::remove(parent);
  ASSERT_FALSE(errors[0].empty()) << "rank 0 prepares the directory and must fail";
  // Rank 0's own message (after the location prefix, if any) appears in every rank's error.
  const std::string root_cause = errors[0].substr(errors[0].find(parent));
  for (int r = 1; r < 4; ++r) {
    EXPECT_NE(errors[static_cast<size_t>(r)].find("failed on rank 0"), std::string::npos) << errors[static_cast<size_t>(r)];
    EXPECT_NE(errors[static_cast<size_t>(r)].find(root_cause), std::string::npos)
        << "rank " << r << " says: " << errors[static_cast<size_t>(r)] << "\nrank 0 says: " << errors[0];
  }
}

using nlohmann::json;

std::string manifest_of(const std::string& dir) { return dir + "/manifest.json"; }

std::string read_text(const std::string& path) {
  const std::vector<char> bytes = ckpt::read_file(path);
  return {bytes.begin(), bytes.end()};
}
void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

// Applies edit to dir's manifest and rewrites it with the checksum recomputed as documented (the
// CRC-32 of the compact dump, keys sorted, without "manifest_crc32"), so that a later check, not
// the checksum, is what a test meets. Computed here, independently of the library's code.
void edit_manifest(const std::string& dir, const std::function<void(json&)>& edit) {
  json m = json::parse(read_text(manifest_of(dir)));
  edit(m);
  m.erase("manifest_crc32");
  const std::string canonical = m.dump();
  m["manifest_crc32"] = ckpt::crc32_of(std::vector<char>(canonical.begin(), canonical.end()));
  write_text(manifest_of(dir), m.dump(1));
}

// Re-encodes rank file `name` with change() applied to its tensor list and records the new size
// and CRC in the (resealed) manifest: the file is intact as far as checksums go, so only the
// check of each tensor's dtype and size can catch what changed.
void rewrite_rank_file(const std::string& dir, const std::string& name,
                       const std::function<void(std::vector<ckpt::TensorToWrite>&)>& change) {
  const std::string path = dir + "/" + name;
  const std::vector<char> bytes = ckpt::read_file(path);
  std::vector<ckpt::TensorToWrite> tensors;
  for (const auto& [tname, e] : ckpt::decode_safetensors(bytes, path))
    tensors.push_back({tname, e.dtype, e.numel, bytes.data() + e.offset});
  change(tensors);
  const std::vector<char> out = ckpt::encode_safetensors(tensors, {{"format", "mxddp-checkpoint"}});
  { std::ofstream(path, std::ios::binary).write(out.data(), static_cast<std::streamsize>(out.size())); }
  edit_manifest(dir, [&](json& m) {
    for (json& f : m.at("files"))
      if (f.at("name") == name) {
        f["bytes"] = out.size();
        f["crc32"] = ckpt::crc32_of(out);
      }
  });
}

// Whether any of the problems contains needle.
bool mentions(const std::vector<std::string>& problems, const std::string& needle) {
  for (const std::string& p : problems)
    if (p.find(needle) != std::string::npos) return true;
  return false;
}

// Issue 15.13: an edited step or iteration passed inspect and resumed at the wrong iteration.
TEST(CheckpointTrust, EditedManifestIsRefusedByLoadAndInspect) {
  const std::string dir = saved_checkpoint("edited");
  const std::string original = read_text(manifest_of(dir));
  for (const auto& [from, to] : {std::pair<std::string, std::string>{"\"step\": 3", "\"step\": 5"},
                                 {"\"next_step\": \"3\"", "\"next_step\": \"5\""}}) {
    std::string edited = original;
    ASSERT_NE(edited.find(from), std::string::npos) << from << " not in " << original;
    edited.replace(edited.find(from), from.size(), to);
    write_text(manifest_of(dir), edited);
    expect_load_fails_and_changes_nothing(dir, "checksum");
    try {
      inspect_checkpoint(dir);
      ADD_FAILURE() << "inspect accepted a manifest edited from " << from << " to " << to;
    } catch (const Error& e) {
      EXPECT_NE(e.message().find(manifest_of(dir)), std::string::npos) << e.message();
      EXPECT_NE(e.message().find("checksum"), std::string::npos) << e.message();
    }
  }
  fs::remove_all(dir);
}

// A version-1 manifest has no checksum to verify: refused, not silently accepted.
TEST(CheckpointTrust, VersionOneManifestIsRefused) {
  const std::string dir = saved_checkpoint("v1");
  json m = json::parse(read_text(manifest_of(dir)));
  m["version"] = 1;
  m.erase("manifest_crc32");
  write_text(manifest_of(dir), m.dump(1));
  expect_load_fails_and_changes_nothing(dir, "predates manifest checksums");
  EXPECT_THROW(inspect_checkpoint(dir), Error);
  fs::remove_all(dir);
}

// Numbers a sealed manifest may still hold: floats, negatives and values past the field's type used
// to be cast by nlohmann's get<int64_t>() (undefined behaviour for 1e30) or wrapped (2^40 as an
// int). Each is an error naming the field, from load and from inspect.
TEST(CheckpointTrust, ManifestNumbersOutOfRangeAreErrorsNotCasts) {
  const std::string dir = saved_checkpoint("numbers");
  const std::string original = read_text(manifest_of(dir));
  const std::vector<std::pair<std::function<void(json&)>, std::string>> edits = {
      {[](json& m) { m["step"] = 1e30; }, "step is 1e+30; expected an integer in [0, 9007199254740992]"},
      {[](json& m) { m["step"] = INT64_MAX; }, "step is 9223372036854775807; expected an integer in [0, 9007199254740992]"},
      {[](json& m) { m["step"] = -3; }, "step is -3; expected an integer in [0, "},
      {[](json& m) { m["dp"] = int64_t{1} << 40; }, "dp is 1099511627776; expected an integer in [1, 2147483647]"},
      {[](json& m) { m["files"][0]["bytes"] = 1.5; }, "files[0].bytes is 1.5"},
      {[](json& m) { m["files"][0]["crc32"] = uint64_t{1} << 33; }, "files[0].crc32 is 8589934592"},
      {[](json& m) { m["params"][0]["slices"][0]["start"] = -1; }, "a slice's start is -1"},
      {[](json& m) { m["params"][0]["shape"][0] = 92233720368547758070.0; }, "a dimension of shape"},
  };
  for (const auto& [edit, needle] : edits) {
    write_text(manifest_of(dir), original);
    edit_manifest(dir, edit);
    expect_load_fails_and_changes_nothing(dir, needle);
    try {
      inspect_checkpoint(dir);
      ADD_FAILURE() << "inspect accepted " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  fs::remove_all(dir);
}

// A file name that leaves the directory, with the CRC of the file it points to, loaded a shard
// from outside the checkpoint.
TEST(CheckpointTrust, FileNameOutsideTheDirectoryIsRefused) {
  const std::string dir = saved_checkpoint("escape");
  const fs::path outside = fs::path(dir).parent_path() / fmt::format("mxddp_ckpt_outside_{}", ::getpid());
  fs::remove_all(outside);
  fs::create_directories(outside);
  fs::copy_file(dir + "/rank_00000.safetensors", outside / "rank_00000.safetensors");
  const std::string escaping = "../" + outside.filename().string() + "/rank_00000.safetensors";
  edit_manifest(dir, [&](json& m) {
    m["files"][0]["name"] = escaping;
    for (json& p : m.at("params"))
      for (json& s : p.at("slices"))
        if (s.at("file") == "rank_00000.safetensors") s["file"] = escaping;
  });
  fs::remove(dir + "/rank_00000.safetensors");
  expect_load_fails_and_changes_nothing(dir, escaping);
  try {
    inspect_checkpoint(dir);
    ADD_FAILURE() << "inspect accepted file name " << escaping;
  } catch (const Error& e) {
    EXPECT_NE(e.message().find(escaping), std::string::npos) << e.message();
  }
  fs::remove_all(outside);
  fs::remove_all(dir);
}

// A rank file whose checksums match the manifest but whose tensors are not what the manifest
// implies: one with the wrong dtype, one with the wrong size.
TEST(CheckpointTrust, InspectAndLoadCheckEveryTensorsDtypeAndSize) {
  const std::string dir = saved_checkpoint("tensors");
  std::string retyped, resized;
  rewrite_rank_file(dir, "rank_00001.safetensors", [&](std::vector<ckpt::TensorToWrite>& tensors) {
    for (ckpt::TensorToWrite& t : tensors) {
      if (retyped.empty() && t.name.starts_with("main/")) {
        t.dtype = DType::kBF16;  // same element count, half the bytes
        retyped = t.name;
      } else if (resized.empty() && t.name.starts_with("exp_avg_sq/") && t.numel > 1) {
        t.numel -= 1;
        resized = t.name;
      }
    }
  });
  ASSERT_FALSE(retyped.empty() || resized.empty());
  const CheckpointInfo info = inspect_checkpoint(dir);
  EXPECT_FALSE(info.ok());
  EXPECT_TRUE(mentions(info.problems, retyped)) << "no problem names " << retyped;
  EXPECT_TRUE(mentions(info.problems, resized)) << "no problem names " << resized;
  EXPECT_EQ(info.files[0].status, "ok");
  EXPECT_NE(info.files[1].status, "ok");
  expect_load_fails_and_changes_nothing(dir, "rank_00001.safetensors");
  fs::remove_all(dir);
}

// A slice dropped from the manifest leaves elements no file holds.
TEST(CheckpointTrust, InspectAndLoadFindACoverageHole) {
  const std::string dir = saved_checkpoint("hole");
  std::string param;
  edit_manifest(dir, [&](json& m) {
    json& slices = m["params"][2]["slices"];
    param = m["params"][2]["name"].get<std::string>();
    slices.erase(slices.begin());
  });
  const CheckpointInfo info = inspect_checkpoint(dir);
  EXPECT_FALSE(info.ok());
  EXPECT_TRUE(mentions(info.problems, "'" + param + "'")) << "no problem names " << param;
  EXPECT_TRUE(mentions(info.problems, "in no slice")) << "no problem reports the hole";
  expect_load_fails_and_changes_nothing(dir, "in no slice");
  fs::remove_all(dir);
}

// A save writes exactly the listed rank files; another rank_*.safetensors beside them (a file of
// another save, e.g. a dp-4 save's rank_00004 left in a dp-4 directory) is refused, though no
// load would read it.
TEST(CheckpointTrust, UnlistedRankFileIsRefusedByLoadAndInspect) {
  const std::string dir = saved_checkpoint("unlisted");
  fs::copy_file(dir + "/rank_00003.safetensors", dir + "/rank_00004.safetensors");
  const CheckpointInfo info = inspect_checkpoint(dir);
  EXPECT_FALSE(info.ok());
  EXPECT_TRUE(mentions(info.problems, "rank_00004.safetensors' is not in the manifest")) << fmt::format("{}", fmt::join(info.problems, "\n"));
  expect_load_fails_and_changes_nothing(dir, "rank_00004.safetensors' is not in the manifest");
  fs::remove(dir + "/rank_00004.safetensors");
  EXPECT_TRUE(inspect_checkpoint(dir).ok());
  fs::remove_all(dir);
}

// A listed file that no rank of the loading run needs is still checked: here a dp-4 save whose
// manifest (resealed) claims dp 5 and lists a fifth file, a copy of rank 0's, that holds no
// slice. Loading at dp 2 reads files 0-3 for the slices; file 4 is checked by rank 4 % 2 = 0.
TEST(CheckpointTrust, LoadChecksTheListedFilesNoRankNeeds) {
  const std::string dir = saved_checkpoint("unneeded");
  fs::copy_file(dir + "/rank_00000.safetensors", dir + "/rank_00004.safetensors");
  edit_manifest(dir, [&](json& m) {
    m["dp"] = 5;
    json extra = m["files"][0];
    extra["name"] = "rank_00004.safetensors";
    m["files"].push_back(extra);
  });
  const CheckpointInfo info = inspect_checkpoint(dir);
  EXPECT_TRUE(mentions(info.problems, "has rank '0' in its metadata; this checkpoint's is '4'"))
      << fmt::format("{}", fmt::join(info.problems, "\n"));
  expect_load_fails_and_changes_nothing(dir, "has rank '0' in its metadata; this checkpoint's is '4'");
  fs::remove_all(dir);
}

// `mxddp ckpt inspect` compares the param list with the one the saved GPT config implies (a
// load compares it with the model it loads into): a resealed flip of shared_embedding, a renamed
// or reshaped param, and a config that is no GPT config are problems; the saved list is none.
TEST(CheckpointTrust, InspectComparesTheParamListWithTheSavedGptConfig) {
  const GptConfig config = gpt_preset("tiny");
  CheckpointInfo info;
  info.model_config = config.fields();
  for (const ParamSpec& spec : gpt_param_specs(config)) info.params.push_back({spec.name, spec.shape, 1, spec.shared_embedding});
  EXPECT_EQ(gpt_checkpoint_problems(info), std::vector<std::string>{});
  CheckpointInfo flipped = info;
  flipped.params[0].shared_embedding = false;
  ASSERT_EQ(gpt_checkpoint_problems(flipped).size(), 1u);
  EXPECT_NE(gpt_checkpoint_problems(flipped)[0].find("implies 'embedding.word_embeddings.weight' [256, 64] (shared embedding)"),
            std::string::npos) << gpt_checkpoint_problems(flipped)[0];
  CheckpointInfo reshaped = info;
  reshaped.params[3].shape = Shape{7};
  EXPECT_TRUE(mentions(gpt_checkpoint_problems(reshaped), "param 3 is")) << "a reshaped param";
  CheckpointInfo fewer = info;
  fewer.params.pop_back();
  EXPECT_TRUE(mentions(gpt_checkpoint_problems(fewer), "lists 27 params; its model_config (2 layers) has 28")) << "a missing param";
  CheckpointInfo huge = info;  // must not build a list of 2^31 layers' specs
  for (auto& [key, value] : huge.model_config)
    if (key == "num_layers") value = "2147483647";
  EXPECT_TRUE(mentions(gpt_checkpoint_problems(huge), "has 25769803768")) << fmt::format("{}", fmt::join(gpt_checkpoint_problems(huge), "\n"));
  CheckpointInfo not_gpt = info;
  not_gpt.model_config.push_back({"num_experts", "8"});
  EXPECT_TRUE(mentions(gpt_checkpoint_problems(not_gpt), "not a GPT config"));
  not_gpt.model_config = {{"vocab_size", "256"}, {"num_layers", "2"}, {"hidden_size", "0x40"}, {"num_attention_heads", "4"},
                          {"seq_length", "64"}};
  EXPECT_TRUE(mentions(gpt_checkpoint_problems(not_gpt), "'hidden_size' is '0x40', not an integer"));
  EXPECT_EQ(gpt_checkpoint_problems(CheckpointInfo{}), std::vector<std::string>{}) << "no saved config, nothing to compare";
}

// Issue 15.13: a 4-head checkpoint loaded into an 8-head model, whose params have the same shapes.
// The model config is compared field by field before anything changes.
TEST(CheckpointTrust, ModelConfigMismatchIsRefusedFieldByField) {
  const std::string dir = fresh_dir("model_config");
  GptConfig four_heads = gpt_preset("tiny");
  four_heads.num_attention_heads = 4;
  GptConfig eight_heads = four_heads;
  eight_heads.num_attention_heads = 8;
  ASSERT_EQ(gpt_param_specs(four_heads).size(), gpt_param_specs(eight_heads).size());
  for (size_t p = 0; p < gpt_param_specs(four_heads).size(); ++p)
    ASSERT_EQ(gpt_param_specs(four_heads)[p].shape, gpt_param_specs(eight_heads)[p].shape) << "param " << p;
  save_after_one_step(dir, {.model_config = four_heads.fields()});
  const CheckpointInfo info = inspect_checkpoint(dir);
  using Fields = std::map<std::string, std::string>;  // a JSON object: in key order
  const auto saved = four_heads.fields();
  EXPECT_EQ(Fields(info.model_config.begin(), info.model_config.end()), Fields(saved.begin(), saved.end()))
      << "every field, as saved";
  expect_load_fails_and_changes_nothing(dir, "num_attention_heads: checkpoint 4, this run 8", mlp_params(),
                                        {.model_config = eight_heads.fields()});
  run_local(2, [&](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DistributedDataParallel ddp(comm, mlp_params(), optim_ddp_config(), tracker, views_of(init));
    DistributedOptimizer opt(ddp, kAdam, tracker);
    try {
      load_checkpoint(dir, opt, {.model_config = eight_heads.fields()});
      ADD_FAILURE() << "loaded a 4-head checkpoint into an 8-head model";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("num_attention_heads: checkpoint 4, this run 8"), std::string::npos) << what;
      EXPECT_EQ(what.find("hidden_size"), std::string::npos) << "only differing fields are listed: " << what;
    }
    load_checkpoint(dir, opt, {.model_config = four_heads.fields()});  // the same model loads
    EXPECT_EQ(opt.step_count(), 1);
  });
  fs::remove_all(dir);
}

// The --json form is one JSON object with the same content and problems.
TEST(CheckpointTrust, InspectJsonHoldsTheSameAsTheText) {
  const std::string dir = saved_checkpoint("json");
  json j = json::parse(checkpoint_info_json(inspect_checkpoint(dir)));
  EXPECT_EQ(j.at("ok"), true);
  EXPECT_EQ(j.at("step"), 3);
  EXPECT_EQ(j.at("saved_dp"), 4);
  EXPECT_EQ(j.at("optimizer"), "adam");
  EXPECT_EQ(j.at("metadata").at("next_step"), "3");
  EXPECT_EQ(j.at("params").size(), mlp_params().size());
  EXPECT_EQ(j.at("files").size(), 4u);
  EXPECT_TRUE(j.at("problems").empty());
  flip_byte(dir + "/rank_00003.safetensors", 5);
  j = json::parse(checkpoint_info_json(inspect_checkpoint(dir)));
  EXPECT_EQ(j.at("ok"), false);
  ASSERT_EQ(j.at("problems").size(), 1u);
  EXPECT_NE(j.at("problems")[0].get<std::string>().find("rank_00003.safetensors' is corrupted"), std::string::npos);
  EXPECT_EQ(j.at("files")[3].at("status"), j.at("problems")[0]);
  fs::remove_all(dir);
}

// Issue 30 point 4 iii: inspect said "model params bf16" for a run whose weights were MXFP8. It
// now names each param's dtype as the run kept it (the MXFP8 element format from the config), and
// keeps model_dtype for what the files hold (bf16, the cast of the main params).
TEST(CheckpointInspect, NamesTheMxfp8ParamsAndTheirElementFormat) {
  const std::string dir = fresh_dir("mxfp8_inspect");
  run_local(2, [&](Communicator& comm) {
    MemoryTracker tracker;
    auto init = mlp_init();
    DdpConfig c = optim_ddp_config();
    c.fp8_param_gather = true;
    c.mxfp8_elem = Fp8Format::kE5M2;
    DistributedDataParallel ddp(comm, mlp_params(/*mxfp8=*/true), c, tracker, views_of(init));
    DistributedOptimizer opt(ddp, kAdam, tracker);
    save_checkpoint(dir, opt, {});
  });
  CheckpointInfo info = inspect_checkpoint(dir);
  ASSERT_TRUE(info.ok()) << fmt::format("{}", fmt::join(info.problems, "; "));
  const std::vector<ParamSpec> specs = mlp_params(true);
  ASSERT_EQ(info.params.size(), specs.size());
  for (size_t p = 0; p < specs.size(); ++p)
    EXPECT_EQ(info.params[p].dtype, specs[p].mxfp8 ? "mxfp8_e5m2" : "bf16") << specs[p].name;
  EXPECT_EQ(info.model_dtype, "bf16");
  EXPECT_EQ(info.param_dtype, "mxfp8_e5m2 (3 params) and bf16 (3 params), saved as bf16");
  const json j = json::parse(checkpoint_info_json(info));
  EXPECT_EQ(j.at("param_dtype"), info.param_dtype);
  EXPECT_EQ(j.at("params")[0].at("dtype"), "mxfp8_e5m2");
  EXPECT_EQ(j.at("params")[1].at("dtype"), "bf16");

  // A save from before the params were marked (no mxfp8_elem on any param, fp8_param_gather in
  // the ddp section) says that it cannot name them, rather than calling them all bf16.
  edit_manifest(dir, [](json& m) {
    for (json& param : m.at("params")) param.erase("mxfp8_elem");
  });
  info = inspect_checkpoint(dir);
  EXPECT_TRUE(info.ok());
  EXPECT_EQ(info.param_dtype, "bf16, MXFP8 for the params the run quantized (this save does not list them)");
  // A format that is not an MXFP8 element format is an error naming it.
  edit_manifest(dir, [](json& m) { m.at("params")[0]["mxfp8_elem"] = "e3m4"; });
  try {
    inspect_checkpoint(dir);
    ADD_FAILURE() << "inspect accepted mxfp8_elem e3m4";
  } catch (const Error& e) {
    EXPECT_NE(e.message().find("param 'l0.w' has mxfp8_elem 'e3m4'; valid: e4m3, e5m2"), std::string::npos)
        << e.message();
  }
  fs::remove_all(dir);

  // Without MXFP8 nothing changes: every param and the summary are the model dtype.
  const std::string plain = saved_checkpoint("plain_inspect");
  info = inspect_checkpoint(plain);
  EXPECT_EQ(info.param_dtype, "bf16");
  for (const CheckpointParamInfo& p : info.params) EXPECT_EQ(p.dtype, "bf16") << p.name;
  fs::remove_all(plain);
}

// Writes a checkpoint for the `mxddp ckpt inspect` CLI tests (run by CTest as a fixture).
TEST(CliFixture, WriteCheckpointForCli) {
  const char* dir = std::getenv("MXDDP_CLI_CKPT_DIR");
  if (dir == nullptr) GTEST_SKIP() << "run by CTest's cli_ckpt fixture only";
  fs::remove_all(dir);
  run_segment(2, 128, 0, 2, "", dir);
  ASSERT_TRUE(inspect_checkpoint(dir).ok());
}

}  // namespace
}  // namespace mxddp::testing
