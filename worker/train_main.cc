// spindle-train: runs one rank of a training job, or evaluates a checkpoint.
//
//   spindle-train --job JOB.json [--rank R --world W] [--checkpoint-dir DIR]
//                 [--lightning-mode allgather|all2all] [--mla-mode allgather|all2all]
//                 [--rendezvous HOST:PORT --job-id ID --attempt N --token-file F]
//                 [--threads N] [--stop-at-step K]
//   spindle-train --eval --job JOB.json --checkpoint DIR [--data SOURCE] [--eval-sequences N]
//
// Prints one JSON object per line on stdout ({"event": "start" | "step" | "checkpoint" | "done" |
// "eval", ...}) and one line "spindle-train: <error>" on stderr when it fails. Exit codes:
// 0 success, 2 invalid input (job spec, data, checkpoint, flags), 1 runtime failure.
#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "worker/engine/trainer.h"

namespace {

constexpr char kUsage[] =
    "usage: spindle-train --job JOB.json [--rank R --world W] [--checkpoint-dir DIR]\n"
    "                     [--lightning-mode M --mla-mode M] [--rendezvous HOST:PORT --job-id ID\n"
    "                     --attempt N --token-file F] [--threads N] [--stop-at-step K]\n"
    "       spindle-train --eval --job JOB.json --checkpoint DIR [--data SOURCE]\n"
    "                     [--eval-sequences N]\n";

int ExitCodeFor(const absl::Status& s) {
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kUnimplemented:
    case absl::StatusCode::kOutOfRange:
      return 2;
    default:
      return 1;
  }
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "spindle-train: %s\n", std::string(s.message()).c_str());
  return ExitCodeFor(s);
}

void PrintEvent(const nlohmann::json& e) {
  std::string line = e.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> flags;
  bool eval = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    if (a == "--eval") {
      eval = true;
      continue;
    }
    static const char* kValued[] = {"--job", "--rank", "--world", "--checkpoint-dir",
                                    "--lightning-mode", "--mla-mode", "--rendezvous", "--job-id",
                                    "--attempt", "--token-file", "--threads", "--stop-at-step",
                                    "--checkpoint", "--data", "--eval-sequences"};
    bool known = false;
    for (const char* k : kValued) known |= a == k;
    if (!known || i + 1 >= argc) {
      std::fprintf(stderr, "spindle-train: %s\n%s",
                   known ? absl::StrCat("flag ", a, " needs a value").c_str()
                         : absl::StrCat("unknown flag ", a).c_str(),
                   kUsage);
      return 2;
    }
    flags[a.substr(2)] = argv[++i];
  }
  auto int_flag = [&](const std::string& name, int64_t def, int64_t* out) -> bool {
    *out = def;
    auto it = flags.find(name);
    if (it == flags.end()) return true;
    if (!absl::SimpleAtoi(it->second, out)) {
      std::fprintf(stderr, "spindle-train: --%s must be an integer, got \"%s\"\n", name.c_str(),
                   it->second.c_str());
      return false;
    }
    return true;
  };
  if (!flags.count("job")) {
    std::fprintf(stderr, "spindle-train: --job is required\n%s", kUsage);
    return 2;
  }
  int64_t threads = 0, rank = 0, world = 1, stop_at = -1, eval_sequences = 4;
  if (!int_flag("threads", 0, &threads) || !int_flag("rank", 0, &rank) ||
      !int_flag("world", 1, &world) || !int_flag("stop-at-step", -1, &stop_at) ||
      !int_flag("eval-sequences", 4, &eval_sequences))
    return 2;
  if (threads > 0) omp_set_num_threads(static_cast<int>(threads));

  auto spec = spindle::LoadJobSpec(flags["job"]);
  if (!spec.ok()) return Fail(spec.status());

  if (eval) {
    if (!flags.count("checkpoint")) {
      std::fprintf(stderr, "spindle-train: --eval needs --checkpoint DIR\n");
      return 2;
    }
    spindle::DataSpec data = spec->data;
    if (flags.count("data")) {
      nlohmann::json j = spec->ToJson();
      j["data"]["source"] = flags["data"];
      auto with_data = spindle::ParseJobSpecJson(j);
      if (!with_data.ok()) return Fail(with_data.status());
      data = with_data->data;
    }
    std::string ckpt = flags["checkpoint"];
    if (auto latest = spindle::LatestCheckpoint(ckpt); latest.ok()) ckpt = *latest;
    auto r = spindle::EvaluateCheckpoint(*spec, ckpt, data, eval_sequences);
    if (!r.ok()) return Fail(r.status());
    nlohmann::json e = {{"event", "eval"},
                        {"checkpoint", ckpt},
                        {"data", data.source},
                        {"sequences", eval_sequences},
                        {"loss", r->loss},
                        {"tokens", r->n_valid}};
    if (r->n_answers > 0) {
      e["answer_loss"] = r->answer_loss;
      e["answer_tokens"] = r->n_answers;
    }
    PrintEvent(e);
    return 0;
  }

  spindle::TrainerOptions options;
  options.spec = *spec;
  options.rank = rank;
  options.world = world;
  options.checkpoint_dir = flags.count("checkpoint-dir") ? flags["checkpoint-dir"] : "";
  options.stop_at_step = stop_at;
  options.on_event = PrintEvent;
  auto trainer = spindle::Trainer::Create(std::move(options));
  if (!trainer.ok()) return Fail(trainer.status());
  absl::Status s = (*trainer)->Run();
  if (!s.ok()) return Fail(s);
  return 0;
}
