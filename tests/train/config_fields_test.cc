// The config descriptions (config_fields.h): every described field of DdpConfig, FsdpConfig,
// OptimizerConfig and GptConfig reaches `mxddp train`'s flags (or is one the command sets), its
// report's config and a checkpoint manifest's config, and changing the field through its
// description changes that field's entry there and no other field's. The fields DdpConfig and
// FsdpConfig share are described once (data_parallel_fields.h) and their flags set both.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <mxddp/checkpoint.h>
#include <mxddp/comm.h>
#include <mxddp/fsdp.h>
#include <mxddp/train.h>

#include "optim/mlp.h"
#include "train_cmd.h"
#include "train_report.h"

namespace mxddp::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Fields the command sets rather than takes from a flag of their own (flags ""): the test fails
// when a flag goes missing from a field not listed here, and when a listed field gains one.
const std::set<std::string> kSetByCommand = {"ddp.grad_reduce_in_fp32",  "ddp.use_distributed_optimizer",
                                             "ddp.param_dtype",          "fsdp.grad_reduce_in_fp32",
                                             "fsdp.param_dtype",         "fsdp.megatron_fsdp_main_params_dtype",
                                             "optimizer.lr",             "model.vocab_size"};

// A value other than v, valid for the field wherever it is used below: an enum's first other name
// (param_dtype bf16 -> f32, which checkpoints accept), a flag flipped, a number moved within its
// range.
template <typename T>
T changed(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return !v;
  } else if constexpr (NamedEnum<T>) {
    for (const std::string& name : FieldEnum<T>::names())
      if (name != FieldEnum<T>::name(v)) return FieldEnum<T>::parse(name);
    ADD_FAILURE() << "an enum of one value";
    return v;
  } else if constexpr (kIsOptional<T>) {
    return v ? typename T::value_type(*v + 1) : typename T::value_type(1000);
  } else if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(v + 1);
  } else {
    return static_cast<T>(v == T(0.5) ? 0.25 : 0.5);  // inside every float field's range
  }
}

// The text a flag is given to set the value `changed` gives ("" for a bool flag: given alone).
template <typename T>
std::string cli_text(const T& v) {
  if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, std::optional<bool>>) return "";
  else if constexpr (NamedEnum<T>) return std::string(FieldEnum<T>::name(v));
  else if constexpr (kIsOptional<T>) return cli_text(*v);
  else return fmt::format("{}", v);
}

std::string first_flag(std::string_view flags) { return std::string(flags.substr(0, flags.find(','))); }

// Every spelling of a field's flags as written in its description: "!--no-x" is CLI11's negation
// of --x (a tri-state field's explicit off).
std::vector<std::string> all_flags(std::string_view flags) {
  std::vector<std::string> out;
  while (!flags.empty()) {
    const size_t comma = flags.find(',');
    out.emplace_back(flags.substr(0, comma));
    flags = comma == std::string_view::npos ? std::string_view{} : flags.substr(comma + 1);
  }
  return out;
}

bool is_negation(std::string_view flag) { return flag.starts_with('!'); }
// The flag as typed on the command line.
std::string typed(std::string_view flag) { return std::string(is_negation(flag) ? flag.substr(1) : flag); }

// Calls fn(section, field, config) for every described field of the four configs, with the
// config the field belongs to (its default).
template <typename Fn>
void for_every_field(Fn&& fn) {
  for_each_field<DdpConfig>([&](const auto& f) { fn("ddp", f, DdpConfig{}); });
  for_each_field<FsdpConfig>([&](const auto& f) { fn("fsdp", f, FsdpConfig{}); });
  for_each_field<OptimizerConfig>([&](const auto& f) { fn("optimizer", f, OptimizerConfig{}); });
  for_each_field<GptConfig>([&](const auto& f) { fn("model", f, gpt_preset("tiny")); });
}

TEST(ConfigFields, NamesAreSnakeCaseUniqueAndMembersDistinct) {
  std::set<std::string> names;
  for_every_field([&](std::string_view section, const auto& f, auto config) {
    const std::string key = fmt::format("{}.{}", section, f.name);
    EXPECT_TRUE(names.insert(key).second) << key << " is described twice";
    EXPECT_EQ(std::string(f.name).find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_"), std::string::npos) << key;
    EXPECT_EQ(f.has_flag(), kSetByCommand.count(key) == 0) << key << ": a flag, or listed as set by the command";
    using T = typename std::remove_cvref_t<decltype(f)>::value_type;
    for (const std::string& flag : all_flags(f.flags)) {
      EXPECT_TRUE(typed(flag).starts_with("--")) << key << " " << flag;
      // A negation only of a tri-state: a bool's would leave its member unchanged or inverted
      // without the field knowing.
      constexpr bool kTriState = std::is_same_v<T, std::optional<bool>>;
      EXPECT_TRUE(!is_negation(flag) || kTriState) << key << " " << flag;
    }
    if constexpr (std::is_same_v<T, std::optional<bool>>) {  // on and off: both spelled
      const auto flags = all_flags(f.flags);
      EXPECT_EQ(std::count_if(flags.begin(), flags.end(), is_negation), 1) << key;
    }
    if (f.has_flag()) {  // Megatron's spelling first: the field's name in kebab-case
      std::string kebab(f.name);
      std::replace(kebab.begin(), kebab.end(), '_', '-');
      EXPECT_EQ(first_flag(f.flags), "--" + kebab) << key;
    }
    // No two descriptions of a config point at one member.
    std::set<const void*> members;
    for_each_field(config, [&](const auto&, const auto& value) { members.insert(&value); });
    EXPECT_EQ(members.size(), std::tuple_size_v<decltype(config_fields<decltype(config)>())>) << section;
  });
}

// A field DdpConfig and FsdpConfig both describe is one of the shared fields, described once (the
// same name, flags and help in both), so its flag is registered once and sets both configs.
TEST(ConfigFields, FieldsDdpAndFsdpHaveInCommonAreTheSharedOnes) {
  std::map<std::string, std::pair<std::string, std::string>> ddp;  // name -> (flags, help)
  for_each_field<DdpConfig>([&](const auto& f) { ddp[std::string(f.name)] = {std::string(f.flags), std::string(f.help)}; });
  int shared = 0;
  for_each_field<FsdpConfig>([&](const auto& f) {
    const std::string name(f.name);
    EXPECT_EQ(is_shared_data_parallel_field<FsdpConfig>(name), is_shared_data_parallel_field<DdpConfig>(name)) << name;
    if (!ddp.count(name)) {
      EXPECT_FALSE(is_shared_data_parallel_field<FsdpConfig>(name)) << name;
      return;
    }
    EXPECT_TRUE(is_shared_data_parallel_field<FsdpConfig>(name)) << name << " is in both configs but not shared";
    EXPECT_EQ(ddp.at(name), std::make_pair(std::string(f.flags), std::string(f.help))) << name;
    ++shared;
  });
  EXPECT_EQ(shared, std::tuple_size_v<decltype(describe_shared_data_parallel_fields<FsdpConfig>())>);
  // Every shared field, copied from DdpConfig, and nothing else of FsdpConfig.
  DdpConfig d;
  for_each_field(d, [](const auto& f, auto& value) {
    if (is_shared_data_parallel_field<DdpConfig>(f.name)) value = changed(value);
  });
  FsdpConfig fsdp;
  copy_shared_data_parallel_fields(d, fsdp);
  for_each_field(fsdp, [&](const auto& f, const auto& value) {
    if (!is_shared_data_parallel_field<FsdpConfig>(f.name)) {
      EXPECT_EQ(field_value(value), field_value(f.of(FsdpConfig{}))) << f.name;
      return;
    }
    for_each_field(d, [&](const auto& g, const auto& ddp_value) {
      if (g.name == f.name) {
        EXPECT_EQ(field_value(value), field_value(ddp_value)) << f.name;
      }
    });
    EXPECT_NE(field_value(value), field_value(f.of(FsdpConfig{}))) << f.name;
  });
}

// GptConfig::fields() (what a checkpoint stores as model_config) is written by hand: it must name
// the described fields, in order, with the members' values.
TEST(ConfigFields, GptFieldsAgreeWithTheDescription) {
  GptConfig c = gpt_preset("small");
  std::vector<std::string> described;
  for_each_field(c, [&](const auto& f, auto& value) {
    described.emplace_back(f.name);
    value = changed(value);
    const auto fields = c.fields();
    const auto it = std::find_if(fields.begin(), fields.end(), [&](const auto& p) { return p.first == f.name; });
    ASSERT_NE(it, fields.end()) << f.name;
    EXPECT_EQ(it->second, std::to_string(value)) << f.name;
  });
  std::vector<std::string> stored;
  for (const auto& [name, value] : c.fields()) stored.push_back(name);
  EXPECT_EQ(stored, described);
}

// (a) Every flag of a described field is in `mxddp train --help` and sets that field.
TEST(ConfigFields, EveryFlagIsInTheHelpAndSetsItsField) {
  std::string help;
  {
    CLI::App app("mxddp");
    app::TrainArgs args;
    help = app::add_train_command(app, args)->help();
  }
  for_every_field([&](std::string_view section, const auto& f, auto base) {
    using Config = decltype(base);
    for (const std::string& flag : all_flags(f.flags))
      EXPECT_NE(help.find(typed(flag)), std::string::npos) << flag << " (" << section << "." << f.name << ") not in --help";
    for (const std::string& flag : all_flags(f.flags)) {
      CLI::App app("mxddp");
      app::TrainArgs args;
      add_train_command(app, args);
      using T = typename std::remove_cvref_t<decltype(f)>::value_type;
      T value = changed(f.of(base));
      if constexpr (std::is_same_v<T, std::optional<bool>>) value = !is_negation(flag);  // --x on, --no-x off
      std::vector<std::string> argv = {"train", typed(flag)};
      if (!cli_text(value).empty()) argv.push_back(cli_text(value));
      std::reverse(argv.begin(), argv.end());  // CLI11 parses a vector from its back
      ASSERT_NO_THROW(app.parse(argv)) << flag;
      Config parsed{};
      if constexpr (std::is_same_v<Config, DdpConfig>) parsed = args.config.ddp;
      else if constexpr (std::is_same_v<Config, OptimizerConfig>) parsed = args.config.optimizer;
      else if constexpr (std::is_same_v<Config, FsdpConfig>) {
        // A shared field's flag is DdpConfig's; the command puts the flags together into FsdpConfig.
        ASSERT_NO_THROW(app::finish_train_config(args)) << flag;
        parsed = args.config.fsdp;
      }
      else {
        parsed = base;
        for (const auto& apply : args.model_overrides) apply(parsed);
      }
      EXPECT_TRUE(f.of(parsed) == value) << flag << " did not set " << section << "." << f.name;
      // ... and nothing else of that config.
      Config expect = base;
      f.of(expect) = value;
      EXPECT_EQ(field_values(parsed), field_values(expect)) << flag;
    }
  });
}

// --- The report

json report_config(const TrainConfig& c) {
  const fs::path path = fs::temp_directory_path() / fmt::format("mxddp_config_fields_report_{}.json", ::getpid());
  TrainResult r;
  r.steps.push_back({.iteration = 1, .loss = 5.0});
  r.memory_by_rank.resize(2);
  app::write_train_report(path.string(), c, r, 2, "local");
  std::ifstream in(path);
  json j = json::parse(in);
  fs::remove(path);
  return j.at("config");
}

template <typename Config>
Config& section_of(TrainConfig& c) {
  if constexpr (std::is_same_v<Config, DdpConfig>) return c.ddp;
  else if constexpr (std::is_same_v<Config, FsdpConfig>) return c.fsdp;
  else if constexpr (std::is_same_v<Config, OptimizerConfig>) return c.optimizer;
  else return c.model;
}

// Every described key of `section` other than `name` is the same in a and b.
void expect_only_changed(const json& a, const json& b, std::string_view section, std::string_view name,
                         const std::set<std::string>& also = {}) {
  for (const auto& [key, value] : a.items()) {
    if (key == name || also.count(key)) continue;
    if (section == "model" && (key == "num_params" || key == "train_flops_per_token")) continue;  // derived
    if (section == "fsdp" && key == "fine_grained_param_gather") continue;  // the policy's decision
    EXPECT_EQ(value, b.at(key)) << "changing " << section << "." << name << " changed " << key;
  }
}

// (b) Every described field is in the report's config, and changing it changes its entry only.
TEST(ConfigFields, EveryFieldReachesTheReport) {
  const TrainConfig base;
  const json before = report_config(base);
  for_every_field([&](std::string_view section, const auto& f, auto config) {
    using Config = decltype(config);
    const std::string s(section), name(f.name);
    ASSERT_TRUE(before.at(s).contains(name)) << s << "." << name << " is not in the report";
    TrainConfig c = base;
    f.of(section_of<Config>(c)) = changed(f.of(section_of<Config>(c)));
    const json after = report_config(c);
    if (s == "optimizer" && name == "lr") {  // the report shows the schedule's peak, what train() uses
      EXPECT_EQ(after.at(s).at(name), json(base.lr));
    } else if (s == "ddp" && name == "use_distributed_optimizer") {  // train() forces it on
      EXPECT_EQ(after.at(s).at(name), json(true));
    } else {
      EXPECT_NE(after.at(s).at(name), before.at(s).at(name)) << s << "." << name << " did not change in the report";
      json expected;
      std::visit([&expected](const auto& v) { expected = v; }, field_value(f.of(section_of<Config>(c))));
      EXPECT_EQ(after.at(s).at(name), expected);
    }
    expect_only_changed(before.at(s), after.at(s), section, name);
  });
  // The report writes the strings it always did.
  EXPECT_EQ(before.at("optimizer").at("optimizer"), "adam");
  EXPECT_EQ(before.at("lr_decay_style"), "cosine");
  EXPECT_EQ(before.at("ddp").at("param_dtype"), "bf16");
  EXPECT_EQ(before.at("ddp").at("mxfp8_elem"), "e4m3");
  EXPECT_EQ(before.at("ddp").at("bucket_size"), json(nullptr));
  EXPECT_EQ(before.at("fsdp").at("data_parallel_sharding_strategy"), "optim_grads_params");
  EXPECT_EQ(before.at("fsdp").at("megatron_fsdp_main_params_dtype"), "f32");
  EXPECT_EQ(before.at("fsdp").at("megatron_fsdp_enable_fine_grained_param_gather"), json(nullptr));
  EXPECT_EQ(before.at("fsdp").at("fine_grained_param_gather_policy"), "recompute-aware");
  EXPECT_EQ(before.at("fsdp").at("suggested_communication_unit_size"), json(nullptr));
  EXPECT_EQ(before.at("fsdp").at("fine_grained_param_gather").at("on"), false);
}

// --- The checkpoint manifest

// Saves a checkpoint of the MLP at dp 1 with these configs (DDP, or FSDP with each layer a unit
// when fsdp_config is given) and returns its manifest.
json saved_manifest(const DdpConfig& ddp_config, const OptimizerConfig& opt_config, const GptConfig& model,
                    const std::optional<FsdpConfig>& fsdp_config = std::nullopt) {
  const fs::path dir = fs::temp_directory_path() / fmt::format("mxddp_config_fields_ckpt_{}", ::getpid());
  fs::remove_all(dir);
  run_local(1, [&](Communicator& comm) {
    MemoryTracker tracker;
    std::unique_ptr<DataParallel> dp;
    std::vector<std::vector<float>> init = mlp_init();
    if (fsdp_config)
      dp = std::make_unique<FullyShardedDataParallel>(comm, mlp_params(), std::vector<std::vector<int>>{{0, 1}, {2, 3}, {4, 5}},
                                                      *fsdp_config, tracker, views_of(init));
    else
      dp = std::make_unique<DistributedDataParallel>(comm, mlp_params(), ddp_config, tracker);
    DistributedOptimizer opt(*dp, opt_config, tracker);
    save_checkpoint(dir.string(), opt, {.model_config = model.fields()});
  });
  std::ifstream in(dir / "manifest.json");
  json j = json::parse(in);
  fs::remove_all(dir);
  return j;
}

// (c) Every described field is in a checkpoint manifest's config, and changing it changes its
// entry only.
TEST(ConfigFields, EveryFieldReachesTheManifest) {
  // Overlapped param gather on, so that the gather may also overlap the optimizer step.
  const DdpConfig base_ddp{.use_distributed_optimizer = true, .overlap_param_gather = true};
  const OptimizerConfig base_opt;
  const GptConfig base_model = gpt_preset("tiny");
  const FsdpConfig base_fsdp;
  const json before = saved_manifest(base_ddp, base_opt, base_model);
  const json before_fsdp = saved_manifest(base_ddp, base_opt, base_model, base_fsdp);
  EXPECT_FALSE(before.contains("fsdp"));
  EXPECT_FALSE(before_fsdp.contains("ddp"));
  const std::map<std::string, std::string> section_key = {
      {"ddp", "ddp"}, {"fsdp", "fsdp"}, {"optimizer", "optimizer"}, {"model", "model_config"}};
  for_every_field([&](std::string_view section, const auto& f, auto) {
    const std::string s(section), name(f.name), key = section_key.at(s);
    const json& base = s == "fsdp" ? before_fsdp : before;
    ASSERT_TRUE(base.at(key).contains(name)) << s << "." << name << " is not in the manifest";
    if (s == "ddp" && name == "use_distributed_optimizer") {  // a DistributedOptimizer needs it on
      EXPECT_EQ(base.at(key).at(name), json(true));
      return;
    }
    if (s == "fsdp" && name == "megatron_fsdp_main_params_dtype") {  // FSDP takes f32 only
      EXPECT_EQ(base.at(key).at(name), "f32");
      return;
    }
    DdpConfig d = base_ddp;
    FsdpConfig fc = base_fsdp;
    OptimizerConfig o = base_opt;
    GptConfig m = base_model;
    std::set<std::string> also;
    using Owner = typename std::remove_cvref_t<decltype(f)>::config_type;
    if constexpr (std::is_same_v<Owner, FsdpConfig>) {
      f.of(fc) = changed(f.of(fc));
    } else if constexpr (std::is_same_v<Owner, DdpConfig>) {
      f.of(d) = changed(f.of(d));
      if (name == "reuse_grad_buf_for_mxfp8_param_ag") {  // needs it
        d.fp8_param_gather = true;
        also.insert("fp8_param_gather");
      }
    } else if constexpr (std::is_same_v<Owner, OptimizerConfig>) {
      f.of(o) = changed(f.of(o));
    } else {
      f.of(m) = changed(f.of(m));
    }
    const json after = s == "fsdp" ? saved_manifest(d, o, m, fc) : saved_manifest(d, o, m);
    EXPECT_NE(after.at(key).at(name), base.at(key).at(name)) << s << "." << name << " did not change in the manifest";
    expect_only_changed(base.at(key), after.at(key), section, name, also);
  });
  // Written as before: the strings, and what the old manifests held.
  EXPECT_EQ(before.at("optimizer").at("optimizer"), "adam");
  EXPECT_EQ(before.at("ddp").at("param_dtype"), "bf16");
  EXPECT_EQ(before.at("ddp").at("mxfp8_elem"), "e4m3");
  EXPECT_EQ(before.at("ddp").at("mxfp8_scale_mode"), "rceil");
  EXPECT_EQ(before_fsdp.at("fsdp").at("data_parallel_sharding_strategy"), "optim_grads_params");
  EXPECT_EQ(before_fsdp.at("fsdp").at("mxfp8_elem"), "e4m3");
}

// The optimizer's name check on load reads old manifests as new ones: a checkpoint saved by SGD is
// refused by Adam with the names, whatever else the manifest's config holds.
TEST(ConfigFields, OptimizerNamesRoundTrip) {
  for (const std::string& name : FieldEnum<OptimizerType>::names())
    EXPECT_EQ(optimizer_name(parse_optimizer(name)), name);
  for (const std::string& name : FieldEnum<LrDecayStyle>::names())
    EXPECT_EQ(lr_decay_style_name(parse_lr_decay_style(name)), name);
  EXPECT_THROW(parse_optimizer("adamw"), Error);
  EXPECT_THROW(parse_lr_decay_style("step"), Error);
}

}  // namespace
}  // namespace mxddp::testing
