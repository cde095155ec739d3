// Fuzz target: checkpoint loading (LoadCheckpoint), the state.json reader and the safetensors
// readers together, on files written into a temporary checkpoint directory. The loader must
// give a TrainState or an error status (DataLoss, FailedPrecondition, NotFound), never throw or
// crash, and must not touch the parameters when it fails validation.
//
// Input: one flag byte, then state.json, model.safetensors and optimizer.safetensors separated
// by kSeparator. Flag bit 0 set: state.json is written as given; clear: when it parses as an
// object whose "files" is an object, each files entry's "bytes" and "crc32" are set to the real
// size and CRC-32 first, so that mutations reach the header and shape checks past the checksum.
// Flag bit 1 set: an AdamW optimizer is loaded too.
// The model loaded into has two tensors, "w" [2, 3] and "b" [4]; state.json's model must be the
// "tiny" preset. Seeds: corpus/fuzz_checkpoint/, written by this target itself:
//   SPINDLE_FUZZ_WRITE_SEED=<file> ./fuzz_checkpoint -runs=0
#include <unistd.h>
#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "common/job_spec.h"
#include "common/json_fields.h"
#include "worker/engine/checkpoint.h"

namespace {

constexpr std::string_view kSeparator = "\n--8<--\n";

std::string g_dir;  // the checkpoint directory, rewritten for every input

void WriteFile(const std::string& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void Declare(spindle::ParamSet& params) {
  params.Add("w", {2, 3}, spindle::ParamInit::kNormal);
  params.Add("b", {4}, spindle::ParamInit::kNormal);
  params.Allocate(7);
}

spindle::ModelConfig Config() { return *spindle::ModelPreset("tiny"); }

spindle::TrainSpec AdamW() {
  spindle::TrainSpec t;
  t.optimizer = "adamw";
  return t;
}

// state.json with the recorded sizes and checksums of the two tensor files set to the real ones.
std::string FixUpFiles(std::string_view state, std::string_view model, std::string_view opt) {
  if (!spindle::JsonDepthWithin(state)) return std::string(state);
  nlohmann::json st = nlohmann::json::parse(state, nullptr, /*allow_exceptions=*/false);
  if (st.is_discarded() || !st.is_object() || !st.contains("files") || !st["files"].is_object())
    return std::string(state);
  for (const auto& [name, bytes] :
       {std::pair<const char*, std::string_view>{"model.safetensors", model},
        {"optimizer.safetensors", opt}}) {
    nlohmann::json& rec = st["files"][name];
    if (!rec.is_object()) continue;
    rec["bytes"] = bytes.size();
    rec["crc32"] = static_cast<uint32_t>(
        crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
  }
  return st.dump();
}

// Writes a valid checkpoint of the model with SaveCheckpoint and packs it as one input.
void WriteSeed(const char* path) {
  spindle::ParamSet params;
  Declare(params);
  spindle::Optimizer opt(AdamW(), params);
  spindle::TrainState state{.step = 3, .data_position = 6, .seed = 1, .rng_counter = 9};
  const std::string root = g_dir + "/seed";
  auto dir = spindle::SaveCheckpoint(root, params, &opt, Config(), state, 1);
  if (!dir.ok()) std::abort();
  std::string seed = "\x02";
  seed += ReadFile(*dir + "/state.json");
  seed += kSeparator;
  seed += ReadFile(*dir + "/model.safetensors");
  seed += kSeparator;
  seed += ReadFile(*dir + "/optimizer.safetensors");
  WriteFile(path, seed);
  std::filesystem::remove_all(root);
}

void RemoveDir() { std::filesystem::remove_all(g_dir); }

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::string tmpl =
      (std::filesystem::exists("/dev/shm") ? std::string("/dev/shm") : std::string("/tmp")) +
      "/spindle-fuzz-checkpoint-XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) std::abort();
  g_dir = tmpl;
  std::atexit(RemoveDir);
  if (const char* seed = std::getenv("SPINDLE_FUZZ_WRITE_SEED")) WriteSeed(seed);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t flags = data[0];
  std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::vector<std::string_view> parts;
  for (int i = 0; i < 2; ++i) {
    const size_t at = rest.find(kSeparator);
    if (at == std::string_view::npos) break;
    parts.push_back(rest.substr(0, at));
    rest.remove_prefix(at + kSeparator.size());
  }
  parts.push_back(rest);
  while (parts.size() < 3) parts.push_back("");
  const std::string state =
      (flags & 1) ? std::string(parts[0]) : FixUpFiles(parts[0], parts[1], parts[2]);
  WriteFile(g_dir + "/state.json", state);
  WriteFile(g_dir + "/model.safetensors", parts[1]);
  WriteFile(g_dir + "/optimizer.safetensors", parts[2]);

  spindle::ParamSet params;
  Declare(params);
  std::unique_ptr<spindle::Optimizer> opt;
  if (flags & 2) opt = std::make_unique<spindle::Optimizer>(AdamW(), params);
  const std::vector<float> before(params.flat_data().f32(),
                                  params.flat_data().f32() + params.numel());
  auto loaded = spindle::LoadCheckpoint(g_dir, params, opt.get(), Config());
  if (!loaded.ok()) {
    const absl::StatusCode code = loaded.status().code();
    if (code != absl::StatusCode::kDataLoss && code != absl::StatusCode::kFailedPrecondition &&
        code != absl::StatusCode::kNotFound)
      std::abort();
    if (loaded.status().message().size() > 1024) std::abort();
    // Validation failures leave the parameters as they were.
    if (!std::equal(before.begin(), before.end(), params.flat_data().f32())) std::abort();
  }
  return 0;
}
