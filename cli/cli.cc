// The `spindle` command (see cli.h).
#include "cli/cli.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <ostream>
#include <random>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "cli/plan_verify.h"
#include "common/document_span.h"
#include "common/host_port.h"
#include "common/job_spec.h"
#include "common/json_fields.h"
#include "common/message_limits.h"
#include "common/pem.h"
#include "common/text_bounds.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "planner/cp_planner.h"
#include "planner/plan_proto.h"
#include "planner/planned_job.h"
#include "spindle/v1/cluster.grpc.pb.h"
#include "spindle/v1/job.grpc.pb.h"

namespace spindle {
namespace {

constexpr char kUsage[] = R"(usage: spindle [global flags] <command> [args]

commands:
  submit JOB.json [--wait]        validate, plan and queue a job; prints its id
                                  (--wait: then watch it until it ends); retried when the
                                  coordinator is unreachable or slow, never queued twice
  plan JOB.json [--offline]       print the CP plan: modes per layer type and why, the memory
       [--device-memory GIB]      estimate per rank (and how many layers recompute) and every
       [--verify]                 problem; plans offline when the coordinator is unreachable or
                                  with --offline; --device-memory plans offline against a device
                                  of GIB GiB (e.g. 139.8 for an H200), which also sizes recompute
                                  "auto"; --verify then checks the plan's layout against cp = 1
                                  on this machine (spindle-train --verify-only, found through
                                  SPINDLE_TRAIN_BINARY or beside spindle) and prints the parity
                                  table; exit code 2 when the layout does not match
  list [--state S] [--limit N]    jobs, newest first (S: queued, placed, running, succeeded,
       [--mine]                   failed, cancelled, restarting; repeatable); every job, page
                                  by page, or the newest N; --mine: only the jobs you submitted
  status JOB_ID                   one job: state, progress per rank, history
  watch JOB_ID                    live progress (step, loss, tokens/s, ETA) until the job ends
  cancel JOB_ID [--reason TEXT]   stop every rank of a job (yours, or any as an admin)
  workers                         registered workers, their devices and ranks
  workers revoke WORKER_ID        (admins) revoke the worker's certificates and end its
                                  sessions at once; it needs a new bootstrap token to rejoin

global flags:
  --coordinator HOST:PORT   coordinator address (env SPINDLE_COORDINATOR, default 127.0.0.1:7070)
  --token-file FILE         file holding the bearer token (env SPINDLE_TOKEN holds the token
                            itself); --token TOKEN works too but shows the token to every user
                            of this host (process list, shell history), so it warns
  --tls-ca FILE             PEM root certificate: connect with TLS (env SPINDLE_TLS_CA; the
                            coordinator's CA is <db>.ca.pem beside its database)
  --output text|json        output format (default text; json: one JSON object per line)
  --timeout SECONDS         deadline of each call (default 10)
  -h, --help                this help

exit codes:
  0  success
  1  the job failed or was cancelled (watch, submit --wait)
  2  usage error or bad input (invalid job spec, plan problems, job can never fit)
  3  coordinator unreachable
  4  not found, or not authenticated / not allowed
  5  other coordinator error
)";

struct Options {
  std::string command;
  std::vector<std::string> positional;
  std::string coordinator = "127.0.0.1:7070";
  std::string token;
  std::string token_file;
  bool token_on_command_line = false;
  std::string tls_ca;
  std::string output = "text";
  double timeout_s = 10;
  std::vector<std::string> states;
  int limit = 0;
  std::string reason;
  bool wait = false;
  bool offline = false;
  bool mine = false;
  bool verify = false;           // plan: then run the parity canary of the plan here
  std::string trainer_binary;    // plan --verify: spindle-train (VerifyTrainerBinary)
  double device_memory_gib = 0;  // plan: > 0 plans offline against a device of this size
  bool help = false;
};

struct UsageError {
  std::string message;
};

// Parses flags anywhere on the line. Returns an error message or "".
std::string ParseArgs(const std::vector<std::string>& args, Options* o) {
  static const char* kValued[] = {"--coordinator", "--token",        "--token-file", "--tls-ca",
                                  "--output",      "--timeout",      "--state",      "--limit",
                                  "--reason",      "--device-memory"};
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    if (a == "-h" || a == "--help") {
      o->help = true;
      continue;
    }
    if (a == "--wait") {
      o->wait = true;
      continue;
    }
    if (a == "--offline") {
      o->offline = true;
      continue;
    }
    if (a == "--mine") {
      o->mine = true;
      continue;
    }
    if (a == "--verify") {
      o->verify = true;
      continue;
    }
    if (a.size() > 1 && a[0] == '-') {
      std::string name = a, value;
      bool has_value = false;
      if (size_t eq = a.find('='); eq != std::string::npos) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
        has_value = true;
      }
      if (std::find(std::begin(kValued), std::end(kValued), name) == std::end(kValued))
        return absl::StrCat("unknown flag ", name);
      if (!has_value) {
        if (i + 1 >= args.size()) return absl::StrCat("flag ", name, " needs a value");
        value = args[++i];
      }
      if (name == "--coordinator") {
        o->coordinator = value;
      } else if (name == "--token") {
        o->token = value;
        o->token_on_command_line = true;
      } else if (name == "--token-file") {
        o->token_file = value;
      } else if (name == "--tls-ca") {
        o->tls_ca = value;
      } else if (name == "--output") {
        if (value != "text" && value != "json")
          return absl::StrCat("--output must be text or json, got \"", value, "\"");
        o->output = value;
      } else if (name == "--timeout") {
        if (!absl::SimpleAtod(value, &o->timeout_s) || o->timeout_s <= 0)
          return absl::StrCat("--timeout must be a positive number of seconds, got \"", value,
                              "\"");
      } else if (name == "--state") {
        o->states.push_back(value);
      } else if (name == "--limit") {
        if (!absl::SimpleAtoi(value, &o->limit) || o->limit < 0)
          return absl::StrCat("--limit must be a non-negative integer, got \"", value, "\"");
      } else if (name == "--reason") {
        o->reason = value;
      } else if (name == "--device-memory") {
        if (!absl::SimpleAtod(value, &o->device_memory_gib) || !(o->device_memory_gib > 0) ||
            o->device_memory_gib > 1e6)
          return absl::StrCat("--device-memory must be a positive number of GiB, got \"", value,
                              "\"");
      }
      continue;
    }
    if (o->command.empty()) {
      o->command = a;
    } else {
      o->positional.push_back(a);
    }
  }
  return "";
}

int ExitCodeFor(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::OUT_OF_RANGE:
      return kExitUsage;
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return kExitUnreachable;
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      return kExitNotFound;
    default:
      return kExitServerError;
  }
}

std::string StateName(v1::JobState s) {
  switch (s) {
    case v1::JOB_STATE_QUEUED: return "queued";
    case v1::JOB_STATE_PLACED: return "placed";
    case v1::JOB_STATE_RUNNING: return "running";
    case v1::JOB_STATE_SUCCEEDED: return "succeeded";
    case v1::JOB_STATE_FAILED: return "failed";
    case v1::JOB_STATE_CANCELLED: return "cancelled";
    case v1::JOB_STATE_RESTARTING: return "restarting";
    default: return "unknown";
  }
}

bool ParseStateName(const std::string& name, v1::JobState* out) {
  for (int s = v1::JOB_STATE_QUEUED; s <= v1::JOB_STATE_RESTARTING; ++s) {
    if (StateName(static_cast<v1::JobState>(s)) == name) {
      *out = static_cast<v1::JobState>(s);
      return true;
    }
  }
  return false;
}

bool IsTerminalState(v1::JobState s) {
  return s == v1::JOB_STATE_SUCCEEDED || s == v1::JOB_STATE_FAILED ||
         s == v1::JOB_STATE_CANCELLED;
}

// The spec with its relative file paths (checkpoint.dir, the file of a tokens:/text: data source)
// made absolute against this process's working directory: trainers run in their workers' own
// directories, so a path means what it means for `spindle-train` only when it is absolute.
// Anything that is not as expected is left alone for ParseJobSpec to report.
std::string WithAbsolutePaths(const std::string& text) {
  if (!JsonDepthWithin(text)) return text;  // dump() below would recurse through it
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return text;
  bool changed = false;
  auto absolute = [&changed](const std::string& path) {
    if (path.empty() || path[0] == '/') return path;
    changed = true;
    std::error_code ec;
    std::filesystem::path p = std::filesystem::absolute(path, ec);
    return ec ? path : p.lexically_normal().string();
  };
  if (auto c = j.find("checkpoint"); c != j.end() && c->is_object()) {
    if (auto d = c->find("dir"); d != c->end() && d->is_string())
      *d = absolute(d->get<std::string>());
  }
  if (auto d = j.find("data"); d != j.end() && d->is_object()) {
    if (auto src = d->find("source"); src != d->end() && src->is_string()) {
      const std::string source = src->get<std::string>();
      for (const std::string prefix : {"tokens:", "text:"}) {
        if (source.rfind(prefix, 0) == 0 && source.size() > prefix.size())
          *src = prefix + absolute(source.substr(prefix.size()));
      }
    }
  }
  return changed ? j.dump() : text;
}

// The spec text with data.doc_span set to `doc_span` (> 0), as WithDocumentSpan (document_span.h)
// measured it from the data file where this host can read it: the planner, here or in the
// coordinator, then counts attention over the documents as they are. Anything unexpected leaves
// the text.
std::string WithDocumentSpanText(const std::string& text, double doc_span) {
  if (doc_span <= 0 || !JsonDepthWithin(text)) return text;
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return text;
  auto d = j.find("data");
  if (d == j.end() || !d->is_object() || d->contains("doc_span")) return text;
  (*d)["doc_span"] = doc_span;
  return j.dump();
}

// Every string of `m` (nested messages included) as PrintableText: what the coordinator relays from
// users, workers and trainers (names, reasons, notes, stderr lines) reaches the terminal without
// the control characters and escape sequences it may hold.
void MakePrintable(google::protobuf::Message* m) {
  const google::protobuf::Reflection* r = m->GetReflection();
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  r->ListFields(*m, &fields);
  for (const google::protobuf::FieldDescriptor* f : fields) {
    using FD = google::protobuf::FieldDescriptor;
    if (f->cpp_type() == FD::CPPTYPE_STRING) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(*m, f); ++i)
          r->SetRepeatedString(m, f, i, PrintableText(r->GetRepeatedString(*m, f, i)));
      } else {
        r->SetString(m, f, PrintableText(r->GetString(*m, f)));
      }
    } else if (f->cpp_type() == FD::CPPTYPE_MESSAGE) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(*m, f); ++i)
          MakePrintable(r->MutableRepeatedMessage(m, f, i));
      } else {
        MakePrintable(r->MutableMessage(m, f));
      }
    }
  }
}

std::string ToJsonLine(const google::protobuf::Message& m) {
  std::string s;
  google::protobuf::util::JsonPrintOptions opts;
  opts.preserve_proto_field_names = true;
  opts.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &s, opts);
  return s;
}

std::string Duration(double seconds) {
  if (seconds < 0) return "?";
  int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

std::string Rate(double tps) {
  if (tps >= 1e6) return absl::StrFormat("%.2fM", tps / 1e6);
  if (tps >= 1e3) return absl::StrFormat("%.1fk", tps / 1e3);
  return absl::StrFormat("%.0f", tps);
}

// A decided mode as the spec names it (CpModeName), a hybrid with its Ulysses degree.
std::string ModeName(v1::CpMode m, int64_t ulysses = 1) {
  const CpMode mode = m == v1::CP_MODE_UNSPECIFIED ? CpMode::kAllGather : CpModeFromProto(m);
  std::string name(CpModeName(mode));
  if (mode == CpMode::kHybrid) absl::StrAppend(&name, " u=", ulysses);
  return name;
}

// The cost model's candidates, one row each: time, memory and bytes per step.
void PrintEstimates(const v1::Plan& p, std::ostream& out) {
  if (p.step_s() > 0) out << absl::StrFormat("estimated step: %.4g s", p.step_s());
  if (!p.cost_basis().empty()) out << " (" << p.cost_basis() << ")";
  if (p.step_s() > 0) out << "\n";
  if (p.estimates_size() == 0) return;
  out << absl::StrFormat("  %-10s %-12s %10s %10s %10s %10s %10s  %s\n", "layers", "mode",
                         "step s", "compute s", "exposed s", "bytes", "memory", "");
  for (const v1::ModeEstimate& e : p.estimates()) {
    std::string marks;
    if (e.chosen()) marks += " chosen";
    if (e.rule()) marks += " rule";
    if (e.fastest()) marks += " fastest";
    out << absl::StrFormat("  %-10s %-12s %10.4g %10.4g %10.4g %10s %10s %s\n", e.layer_type(),
                           ModeName(e.mode(), e.ulysses()), e.step_s(), e.compute_s(),
                           e.exposed_s(), FormatBytes(e.bytes()), FormatBytes(e.memory_bytes()),
                           marks);
  }
}

void PrintPlan(const v1::Plan& p, std::ostream& out) {
  out << absl::StrFormat("plan: cp=%d dp=%d world=%d, %d tokens per rank\n", p.cp(), p.dp(),
                         p.world(), p.tokens_per_rank());
  if (p.ulysses() > 1)
    out << absl::StrFormat("  hybrid modes: Ulysses groups of %d ranks x %d groups\n", p.ulysses(),
                           p.cp() / p.ulysses());
  for (const v1::LayerPlan& l : p.layers()) {
    out << absl::StrFormat("  %-10s %3d layers  %-9s  %s\n", l.layer_type(), l.num_layers(),
                           ModeName(l.mode(), p.ulysses()), l.reason());
    if (l.comm_bytes_per_step() > 0)
      out << absl::StrFormat(
          "  %-10s sends %s per rank and step%s\n", "", FormatBytes(l.comm_bytes_per_step()),
          l.ring_payload().empty() ? "" : absl::StrCat(" (the ring moves ", l.ring_payload(), ")"));
  }
  PrintEstimates(p, out);
  if (p.ep() > 0) {
    out << absl::StrFormat("  experts:   parallel.ep = %d (%s)\n", p.ep(), p.ep_reason());
    out << absl::StrFormat("  %-10s %4s %10s %12s %12s  %s\n", "", "ep", "memory", "dispatch",
                           "dispatch s", "");
    for (const v1::ExpertParallelEstimate& e : p.ep_estimates())
      out << absl::StrFormat("  %-10s %4d %10s %12s %12.4g %s%s\n", "", e.ep(),
                             FormatBytes(e.memory_bytes()), FormatBytes(e.dispatch_bytes()),
                             e.dispatch_s(), e.fits() ? " fits" : "", e.chosen() ? " chosen" : "");
  }
  const v1::MemoryEstimate& m = p.memory();
  int64_t n_layers = 0;
  for (const v1::LayerPlan& l : p.layers()) n_layers += l.num_layers();
  std::string recompute = "no recompute";
  if (m.recompute_layers() >= n_layers && n_layers > 0) {
    recompute = "every layer recomputes";
  } else if (m.recompute_layers() > 0) {
    recompute =
        absl::StrFormat("the first %d of %d layers recompute", m.recompute_layers(), n_layers);
  }
  out << absl::StrFormat("memory per rank (estimate, %s): %s\n", recompute,
                         FormatBytes(m.total_bytes()));
  out << absl::StrFormat("  params %s, grads %s, optimizer %s, activations %s, workspace %s",
                         FormatBytes(m.params_bytes()), FormatBytes(m.grads_bytes()),
                         FormatBytes(m.optimizer_bytes()), FormatBytes(m.activations_bytes()),
                         FormatBytes(m.workspace_bytes()));
  if (m.runtime_bytes() > 0) out << ", CUDA runtime " << FormatBytes(m.runtime_bytes());
  if (m.precision_bytes() > 0) out << ", precision copies " << FormatBytes(m.precision_bytes());
  if (m.precision_bytes() < 0)  // fp8's codes take less than the bf16 activations they replace
    out << ", precision copies -" << FormatBytes(-m.precision_bytes());
  out << "\n";
  if (m.host_bytes() > 0)
    out << "  offloaded layer inputs: " << FormatBytes(m.host_bytes())
        << " of pinned host memory per rank (not in the total)\n";
  if (m.device_memory_bytes() > 0)
    out << "  device memory: " << FormatBytes(m.device_memory_bytes()) << "\n";
  if (p.max_seq_len() > 0) {
    out << "  longest seq_len that fits it with every layer recomputing (this cp and modes): "
        << p.max_seq_len();
    if (p.max_seq_len_offload() > p.max_seq_len())
      out << " (" << p.max_seq_len_offload() << " with train.offload = true)";
    out << "\n";
  }
  for (const std::string& w : p.warnings()) out << "note: " << w << "\n";
  if (p.problems_size() == 0) {
    out << "ok: the job can run\n";
  } else {
    out << "problems (" << p.problems_size() << "):\n";
    for (const std::string& pr : p.problems()) out << "  - " << pr << "\n";
  }
}

std::string ProgressLine(const v1::Job& j, bool bar) {
  std::string s = absl::StrCat(j.job_id(), " ", StateName(j.state()));
  if (j.total_steps() > 0) {
    const double frac =
        std::clamp(static_cast<double>(j.step()) / static_cast<double>(j.total_steps()), 0.0,
                   1.0);
    if (bar) {
      const int width = 24, fill = static_cast<int>(frac * width + 0.5);
      absl::StrAppend(&s, " [", std::string(fill, '#'), std::string(width - fill, '.'), "]");
    }
    absl::StrAppendFormat(&s, " step %d/%d (%.0f%%)", j.step(), j.total_steps(), frac * 100);
  }
  // A job can be at a step without a loss: a rank that resumed at the last step and exited.
  bool reported = j.ranks_size() == 0;
  for (const v1::RankStatus& r : j.ranks()) reported |= r.last_report_unix_ms() > 0;
  if (j.step() > 0 && reported) {
    absl::StrAppendFormat(&s, " loss %.4f", j.loss());
    if (j.tokens_per_s() > 0) absl::StrAppend(&s, " ", Rate(j.tokens_per_s()), " tok/s");
    if (j.mfu() > 0) absl::StrAppendFormat(&s, " MFU %.1f%%", j.mfu() * 100);
    if (j.state() == v1::JOB_STATE_RUNNING) absl::StrAppend(&s, " ETA ", Duration(j.eta_s()));
  }
  if (j.attempt() > 1) absl::StrAppend(&s, " attempt ", j.attempt());
  return s;
}

// A fresh id for one `spindle submit`: its retries carry it, so a retry after a lost reply
// returns the job the first call created instead of queueing a second one.
std::string RandomRequestId() {
  std::random_device rd;
  std::string id = "cli-";
  for (int i = 0; i < 4; ++i) absl::StrAppend(&id, absl::Hex(rd(), absl::kZeroPad8));
  return id;
}

// Attempts of one submit, and the pause before the first retry (doubled after each).
constexpr int kSubmitAttempts = 4;
constexpr std::chrono::milliseconds kSubmitFirstBackoff{250};
// Jobs per List call.
constexpr int kListPageSize = 500;
// `spindle status` reads a job's events in pages of this many, at most kMaxEventPages of them
// (the coordinator keeps a job's newest 1000 events).
constexpr int kEventPageSize = 500;
constexpr int kMaxEventPages = 4;
// `plan --verify`: how long the check of a job's world on this machine may take.
constexpr absl::Duration kVerifyTimeout = absl::Minutes(10);

std::string FormatTime(int64_t unix_ms) {
  return absl::FormatTime("%H:%M:%S", absl::FromUnixMillis(unix_ms), absl::LocalTimeZone());
}

class Cli {
 public:
  Cli(Options o, std::ostream& out, std::ostream& err, bool tty)
      : o_(std::move(o)), out_(out), err_(err), tty_(tty) {}

  int Run() {
    if (o_.token_on_command_line && !o_.token_file.empty())
      return Fail(kExitUsage, "give --token or --token-file, not both");
    if (o_.token_on_command_line)
      err_ << "spindle: warning: --token shows the token to every user of this host (process "
              "list, shell history); set SPINDLE_TOKEN or use --token-file\n";
    if (!o_.token_file.empty()) {
      std::ifstream f(o_.token_file, std::ios::binary);
      std::stringstream text;
      if (f) text << f.rdbuf();
      if (!f) return Fail(kExitUsage, absl::StrCat("--token-file: cannot read ", o_.token_file));
      o_.token = std::string(absl::StripAsciiWhitespace(text.str()));
      if (o_.token.empty())
        return Fail(kExitUsage, absl::StrCat("--token-file: ", o_.token_file, " is empty"));
    }
    if (!o_.tls_ca.empty()) {
      absl::StatusOr<std::string> pem = ReadPemFile(o_.tls_ca, PemKind::kCertificate, "--tls-ca");
      if (!pem.ok()) return Fail(kExitUsage, std::string(pem.status().message()));
      tls_ca_pem_ = *std::move(pem);
    }
    const std::string& c = o_.command;
    if (c == "workers" && !o_.positional.empty() && o_.positional[0] == "revoke")
      return RevokeWorker();
    if ((c == "list" || c == "workers") && !o_.positional.empty())
      return Fail(kExitUsage, absl::StrCat(c, ": takes no arguments, got \"", o_.positional[0],
                                           "\" (run spindle --help)"));
    if (o_.verify && c != "plan")
      return Fail(kExitUsage, absl::StrCat(c, ": --verify applies to plan only"));
    if (c == "plan") return Plan();
    if (c == "submit") return Submit();
    if (c == "list") return List();
    if (c == "status") return Status();
    if (c == "watch") return Watch();
    if (c == "cancel") return Cancel();
    if (c == "workers") return Workers();
    return Fail(kExitUsage,
                absl::StrCat("unknown command \"", c, "\" (run spindle --help for the list)"));
  }

 private:
  int Fail(int code, const std::string& msg) {
    err_ << "spindle: " << PrintableText(msg) << "\n";
    return code;
  }
  // Strings of a reply about to be printed for a person (JSON output escapes them instead).
  void ForPrinting(google::protobuf::Message* m) const {
    if (!Json()) MakePrintable(m);
  }
  int RpcFail(const grpc::Status& st) {
    std::string msg = st.error_message();
    switch (st.error_code()) {
      case grpc::StatusCode::UNAVAILABLE:
        msg = absl::StrCat("cannot reach the coordinator at ", o_.coordinator, ": ", msg);
        break;
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        msg = absl::StrCat("the coordinator at ", o_.coordinator, " did not answer within ",
                           o_.timeout_s, " s");
        break;
      case grpc::StatusCode::UNAUTHENTICATED:
        msg = absl::StrCat("not authenticated: ", msg, " (set SPINDLE_TOKEN or --token-file)");
        break;
      default:
        break;
    }
    return Fail(ExitCodeFor(st.error_code()), absl::StrCat(o_.command, ": ", msg));
  }

  bool Json() const { return o_.output == "json"; }

  std::shared_ptr<grpc::Channel> Channel() {
    if (!channel_) {
      std::shared_ptr<grpc::ChannelCredentials> creds;
      if (!o_.tls_ca.empty()) {
        grpc::SslCredentialsOptions opts;
        opts.pem_root_certs = tls_ca_pem_;
        creds = grpc::SslCredentials(opts);
      } else {
        creds = grpc::InsecureChannelCredentials();
      }
      grpc::ChannelArguments args;
      args.SetMaxReceiveMessageSize(kMaxGrpcMessageBytes);
      args.SetMaxSendMessageSize(kMaxGrpcMessageBytes);
      channel_ = grpc::CreateCustomChannel(o_.coordinator, creds, args);
    }
    return channel_;
  }
  void Prepare(grpc::ClientContext* ctx, bool deadline = true) {
    if (deadline)
      ctx->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(o_.timeout_s * 1000)));
    if (!o_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + o_.token);
  }

  // Reads a job spec file; "" and an exit code on failure.
  bool ReadSpec(const std::string& path, std::string* text, int* code) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
      *code = Fail(kExitUsage, absl::StrCat(o_.command, ": cannot read job spec ", path,
                                            ": it is a directory"));
      return false;
    }
    std::ifstream f(path, std::ios::binary);
    if (!f) {
      *code = Fail(kExitUsage, absl::StrCat(o_.command, ": cannot read job spec ", path));
      return false;
    }
    std::stringstream ss;
    ss << f.rdbuf();
    *text = ss.str();
    return true;
  }

  bool OnePositional(const char* what, int* code) {
    if (o_.positional.size() != 1) {
      *code = Fail(kExitUsage, absl::StrCat(o_.command, ": expected exactly one ", what,
                                            " (spindle ", o_.command, " ", what, ")"));
      return false;
    }
    return true;
  }

  // Prints the plan of `spec` (the spec text as parsed, or why it did not parse); with --verify,
  // then the parity canary of a plan that can run.
  int EmitPlan(v1::Plan p, const absl::StatusOr<JobSpec>& spec) {
    const v1::Plan plan = p;
    ForPrinting(&p);
    if (Json()) {
      out_ << ToJsonLine(p) << "\n";
    } else {
      PrintPlan(p, out_);
      if (p.ok() && spec.ok()) PrintElasticWorlds(*spec, plan.memory().device_memory_bytes());
    }
    if (!p.ok()) return kExitUsage;
    return o_.verify ? VerifyPlan(spec, plan) : kExitOk;
  }

  // An elastic spec: the layout each world of its range would take (ReplanForWorld, against
  // `device_memory_bytes`, 0: none), largest first; at most kMaxWorldsShown of them.
  void PrintElasticWorlds(const JobSpec& spec, int64_t device_memory_bytes) {
    constexpr int64_t kMaxWorldsShown = 16;
    if (!spec.parallel.elastic.enabled()) return;
    const ElasticSpec& e = spec.parallel.elastic;
    const PlannedJob job = PlanJob(spec, device_memory_bytes);
    if (!job.ok()) return;
    out_ << absl::StrFormat(
        "elastic: world %d..%d; after a lost worker it waits %g s for a replacement, then "
        "resumes at the largest world it can place; grows at a checkpoint (batch \"%s\")\n",
        e.min_world, e.max_world, e.wait_s, std::string(ElasticBatchName(e.batch)));
    int64_t shown = 0;
    for (int64_t w = e.max_world; w >= e.min_world && shown < kMaxWorldsShown; --w, ++shown) {
      std::string change;
      const PlannedJob at = ReplanForWorld(job, w, device_memory_bytes, nullptr, &change);
      if (w == spec.parallel.world()) {
        out_ << "  world " << w << ": as planned above\n";
      } else if (!at.ok()) {
        out_ << "  world " << w << ": does not run (" << at.plan.problems.front() << ")\n";
      } else {
        out_ << "  world " << w << ": " << change << "\n";
      }
    }
    if (e.max_world - e.min_world + 1 > kMaxWorldsShown)
      out_ << "  (" << e.max_world - e.min_world + 1 - kMaxWorldsShown
           << " smaller worlds not shown)\n";
  }

  // plan --verify: the spec with `plan`'s decisions written in, checked by spindle-train
  // --verify-only (cli/plan_verify.h). 0 when the layout passes (or has nothing to verify), 2
  // when it does not or the trainer refuses the job, 1 when the trainer fails otherwise.
  int VerifyPlan(const absl::StatusOr<JobSpec>& spec, const v1::Plan& plan) {
    if (!spec.ok()) return Fail(kExitUsage, absl::StrCat("plan: ", spec.status().message()));
    CpPlan decided;
    PlanFromProto(plan, &decided);
    const std::string planned = PlannedSpec(*spec, decided).ToJson().dump();
    absl::StatusOr<ParityCheck> check = RunParityCheck(o_.trainer_binary, planned, kVerifyTimeout);
    if (!check.ok())
      return Fail(kExitUsage, absl::StrCat("plan --verify: ", check.status().message()));
    if (!check->event) {
      const int code = check->trainer_exit_code == kExitUsage ? kExitUsage : kExitJobFailed;
      return Fail(code, absl::StrCat("plan --verify: ", o_.trainer_binary, " exited with code ",
                                     check->trainer_exit_code, ": ",
                                     check->trainer_error.empty() ? "no parity line"
                                                                  : check->trainer_error));
    }
    if (Json()) {
      out_ << check->event->dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    } else {
      PrintParity(*check->event, out_);
    }
    return ParityOk(*check->event) ? kExitOk : kExitUsage;
  }

  // `spec` is `text` parsed (or why it does not parse).
  int PlanOffline(const std::string& text, const absl::StatusOr<JobSpec>& spec) {
    if (!spec.ok()) return Fail(kExitUsage, absl::StrCat("plan: ", spec.status().message()));
    const auto device = static_cast<int64_t>(o_.device_memory_gib * double(int64_t{1} << 30));
    CpPlan plan = CpPlanner().Plan(*spec, device);
    v1::Plan p;
    PlanToProto(plan, &p);
    return EmitPlan(p, spec);
  }

  int Plan() {
    int code;
    if (!OnePositional("JOB.json", &code)) return code;
    std::string text;
    if (!ReadSpec(o_.positional[0], &text, &code)) return code;
    // Parsed once here: the data file's documents are measured where the CLI can read it (a
    // spec that does not parse goes on as it is, for the planner to name its problem).
    absl::StatusOr<JobSpec> spec = ParseJobSpec(text);
    if (spec.ok()) {
      std::string note;
      *spec = WithDocumentSpan(*std::move(spec), &note);
      text = WithDocumentSpanText(text, spec->data.doc_span);
      if (!note.empty()) err_ << "spindle: plan: " << PrintableText(note) << "\n";
    }
    if (o_.offline || o_.device_memory_gib > 0) return PlanOffline(text, spec);
    v1::PlanJobRequest req;
    req.set_spec_json(text);
    v1::PlanJobResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    grpc::Status st = v1::JobService::NewStub(Channel())->Plan(&ctx, req, &resp);
    if (st.error_code() == grpc::StatusCode::UNAVAILABLE) {
      err_ << "spindle: plan: coordinator at " << o_.coordinator
           << " unreachable; planning offline (memory not checked against a device)\n";
      return PlanOffline(text, spec);
    }
    if (!st.ok()) return RpcFail(st);
    return EmitPlan(resp.plan(), spec);
  }

  int Submit() {
    int code;
    if (!OnePositional("JOB.json", &code)) return code;
    std::string text;
    if (!ReadSpec(o_.positional[0], &text, &code)) return code;
    // Reject a bad spec before contacting anyone: the message names the field.
    absl::StatusOr<JobSpec> spec = ParseJobSpec(text);
    if (!spec.ok()) return Fail(kExitUsage, absl::StrCat("submit: ", spec.status().message()));
    std::string note;
    const JobSpec measured = WithDocumentSpan(*spec, &note);
    text = WithAbsolutePaths(WithDocumentSpanText(text, measured.data.doc_span));
    if (!note.empty()) err_ << "spindle: submit: " << PrintableText(note) << "\n";
    v1::SubmitJobRequest req;
    req.set_spec_json(text);
    req.set_request_id(RandomRequestId());
    v1::SubmitJobResponse resp;
    grpc::Status st;
    auto backoff = kSubmitFirstBackoff;
    for (int attempt = 1;; ++attempt) {
      grpc::ClientContext ctx;
      Prepare(&ctx);
      resp.Clear();
      st = v1::JobService::NewStub(Channel())->Submit(&ctx, req, &resp);
      const bool transient = st.error_code() == grpc::StatusCode::UNAVAILABLE ||
                             st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
      if (!transient || attempt == kSubmitAttempts) break;
      err_ << "spindle: submit: "
           << (st.error_code() == grpc::StatusCode::UNAVAILABLE
                   ? "cannot reach the coordinator at "
                   : "no answer from the coordinator at ")
           << o_.coordinator << "; retrying (attempt " << attempt + 1 << " of " << kSubmitAttempts
           << ")\n";
      std::this_thread::sleep_for(backoff);
      backoff *= 2;
    }
    if (!st.ok()) return RpcFail(st);
    ForPrinting(&resp);
    if (Json()) {
      out_ << ToJsonLine(resp) << "\n";
    } else {
      out_ << "submitted " << resp.job_id() << " (" << StateName(resp.state()) << ")\n";
      for (const std::string& w : resp.plan().warnings()) out_ << "note: " << w << "\n";
    }
    if (!o_.wait) return kExitOk;
    return WatchJob(resp.job_id());
  }

  int List() {
    v1::ListJobsRequest req;
    req.set_mine(o_.mine);
    for (const std::string& s : o_.states) {
      v1::JobState st;
      if (!ParseStateName(s, &st))
        return Fail(kExitUsage, absl::StrCat("list: unknown state \"", s,
                                             "\" (queued, placed, running, succeeded, failed, "
                                             "cancelled, restarting)"));
      req.add_states(st);
    }
    // Page by page: one reply for every job could pass gRPC's message limit.
    v1::ListJobsResponse resp;
    do {
      const int wanted = o_.limit > 0 ? o_.limit - resp.jobs_size() : kListPageSize;
      req.set_page_size(std::min(kListPageSize, wanted));
      v1::ListJobsResponse page;
      grpc::ClientContext ctx;
      Prepare(&ctx);
      grpc::Status st = v1::JobService::NewStub(Channel())->List(&ctx, req, &page);
      if (!st.ok()) return RpcFail(st);
      ForPrinting(&page);
      for (v1::Job& j : *page.mutable_jobs()) resp.add_jobs()->Swap(&j);
      req.set_page_token(page.next_page_token());
    } while (!req.page_token().empty() && (o_.limit <= 0 || resp.jobs_size() < o_.limit));
    if (Json()) {
      // Every page as one object of jobs (no page token: there is no further page).
      std::vector<std::string> jobs;
      for (const v1::Job& j : resp.jobs()) jobs.push_back(ToJsonLine(j));
      out_ << "{\"jobs\":[" << absl::StrJoin(jobs, ",") << "]}\n";
      return kExitOk;
    }
    out_ << absl::StrFormat("%-10s %-20s %-10s %4s %5s %13s %9s %10s  %s\n", "ID", "NAME", "STATE",
                            "PRI", "WORLD", "STEP", "LOSS", "TOK/S", "MESSAGE");
    for (const v1::Job& j : resp.jobs()) {
      out_ << absl::StrFormat("%-10s %-20s %-10s %4d %5d %13s %9s %10s  %s\n", j.job_id(),
                              j.name().substr(0, 20), StateName(j.state()), j.priority(),
                              j.plan().world(),
                              absl::StrCat(j.step(), "/", j.total_steps()),
                              j.step() > 0 ? absl::StrFormat("%.4f", j.loss()) : "-",
                              j.step() > 0 ? Rate(j.tokens_per_s()) : "-", j.message());
    }
    return kExitOk;
  }

  // The job with every event it keeps (page by page: a job keeps up to 1000).
  bool GetJob(const std::string& id, v1::Job* job, int* code) {
    v1::GetJobRequest req;
    req.set_job_id(id);
    req.set_events_page_size(kEventPageSize);
    for (int page = 0;; ++page) {
      v1::Job part;
      grpc::ClientContext ctx;
      Prepare(&ctx);
      grpc::Status st = v1::JobService::NewStub(Channel())->Get(&ctx, req, &part);
      if (!st.ok()) {
        *code = RpcFail(st);
        return false;
      }
      ForPrinting(&part);
      if (page == 0) {
        job->Swap(&part);
      } else {
        for (v1::JobEvent& e : *part.mutable_events()) job->add_events()->Swap(&e);
        job->set_next_events_page_token(part.next_events_page_token());
      }
      // Bounded: the coordinator keeps at most kMaxEventPages pages of events.
      if (job->next_events_page_token().empty() || page + 1 >= kMaxEventPages) break;
      req.set_events_page_token(job->next_events_page_token());
    }
    job->clear_next_events_page_token();
    return true;
  }

  int Status() {
    int code;
    if (!OnePositional("JOB_ID", &code)) return code;
    v1::Job j;
    if (!GetJob(o_.positional[0], &j, &code)) return code;
    if (Json()) {
      out_ << ToJsonLine(j) << "\n";
      return kExitOk;
    }
    out_ << j.job_id() << "  " << j.name() << "  " << StateName(j.state()) << "\n";
    if (!j.message().empty()) out_ << "  " << j.message() << "\n";
    if (!j.owner().empty()) out_ << "  owner " << j.owner() << "\n";
    out_ << absl::StrFormat("  priority %d, attempt %d, restarts %d/%d, world %d (cp=%d dp=%d)",
                            j.priority(), j.attempt(), j.restarts(), j.max_restarts(),
                            j.plan().world(), j.plan().cp(), j.plan().dp());
    // An elastic job: the range its world moves in, and what it was submitted at.
    if (absl::StatusOr<JobSpec> spec = ParseJobSpec(j.spec_json());
        spec.ok() && spec->parallel.elastic.enabled()) {
      const ElasticSpec& e = spec->parallel.elastic;
      out_ << absl::StrFormat(", elastic %d..%d (submitted at %d, batch \"%s\")", e.min_world,
                              e.max_world, spec->parallel.world(),
                              std::string(ElasticBatchName(e.batch)));
    }
    out_ << "\n";
    for (const v1::LayerPlan& l : j.plan().layers())
      out_ << "  " << l.layer_type() << ": " << ModeName(l.mode(), j.plan().ulysses()) << " ("
           << l.reason() << ")\n";
    out_ << "  " << ProgressLine(j, false) << "\n";
    if (j.has_moe()) {
      const v1::MoeStatus& m = j.moe();
      out_ << absl::StrFormat(
          "  experts: ep=%d, load max/mean %.2f (worst layer), bias [%.4f, %.4f], router z %.3f, "
          "dispatch %s in %.3g s a step a rank\n",
          std::max<int64_t>(1, j.plan().ep()), m.load_max_over_mean(), m.bias_min(), m.bias_max(),
          m.router_z_loss(), FormatBytes(static_cast<int64_t>(m.dispatch_bytes())), m.dispatch_s());
    }
    if (j.last_checkpoint_step() > 0)
      out_ << "  last checkpoint: step " << j.last_checkpoint_step() << " "
           << j.last_checkpoint_path() << "\n";
    // The fraction of the job's wall time spent on steps that count (coordinator/goodput.h).
    if (j.goodput() >= 0)
      out_ << absl::StrFormat("  goodput %.1f%% (time on steps that count, of the wall time)\n",
                              j.goodput() * 100);
    if (j.ranks_size() > 0) {
      out_ << absl::StrFormat("  %4s %-16s %3s %-9s %8s %9s %10s %6s %11s\n", "RANK", "WORKER",
                              "DEV", "STATE", "STEP", "LOSS", "TOK/S", "MFU", "PEAK MEM");
      for (const v1::RankStatus& r : j.ranks())
        out_ << absl::StrFormat(
            "  %4d %-16s %3d %-9s %8d %9.4f %10s %6s %11s\n", r.rank(), r.worker_id(),
            r.device_index(), r.state(), r.step(), r.loss(), Rate(r.tokens_per_s()),
            r.mfu() > 0 ? absl::StrFormat("%.1f%%", r.mfu() * 100) : "-",
            r.memory_bytes() > 0 ? FormatBytes(static_cast<int64_t>(r.memory_bytes())) : "-");
    }
    if (j.events_size() > 0) out_ << "  events:\n";
    for (const v1::JobEvent& e : j.events())
      out_ << "    " << FormatTime(e.unix_ms()) << " " << StateName(e.state()) << ": "
           << e.message() << "\n";
    return kExitOk;
  }

  int WatchJob(const std::string& id) {
    v1::JobState final_state = v1::JOB_STATE_UNSPECIFIED;
    std::string final_message;
    bool drew_bar = false;
    // On a terminal the bar redraws in place; each tenth of the steps also leaves its line
    // behind, so the loss curve stays visible.
    int64_t next_kept_step = 0;
    int retries_left = 30;  // reconnect for ~30 s when the coordinator restarts
    // Events already shown: a new stream's first update repeats every event from the start.
    int events_shown = 0;
    bool reconnecting = false;
    while (true) {
      v1::WatchJobRequest req;
      req.set_job_id(id);
      grpc::ClientContext ctx;
      Prepare(&ctx, /*deadline=*/false);
      auto reader = v1::JobService::NewStub(Channel())->Watch(&ctx, req);
      v1::JobUpdate u;
      bool first = true;
      while (reader->Read(&u)) {
        ForPrinting(&u);
        retries_left = 30;
        if (reconnecting) {
          err_ << "spindle: watch: reconnected to " << o_.coordinator << "\n";
          reconnecting = false;
        }
        if (first) {
          const int repeated = std::min(events_shown, u.new_events_size());
          u.mutable_new_events()->DeleteSubrange(0, repeated);
          first = false;
        }
        events_shown += u.new_events_size();
        const v1::Job& j = u.job();
        if (Json()) {
          out_ << ToJsonLine(u) << "\n";
        } else {
          for (const v1::JobEvent& e : u.new_events()) {
            if (drew_bar) out_ << "\r\033[K";
            out_ << FormatTime(e.unix_ms()) << " " << StateName(e.state()) << ": "
                 << e.message() << "\n";
            drew_bar = false;
          }
          if (tty_) {
            out_ << "\r\033[K" << ProgressLine(j, true) << std::flush;
            drew_bar = true;
            const int64_t tenth = std::max<int64_t>(1, j.total_steps() / 10);
            if (j.total_steps() > 0 && j.step() > 0 && j.step() >= next_kept_step &&
                !IsTerminalState(j.state())) {
              out_ << "\n";
              drew_bar = false;
              next_kept_step = (j.step() / tenth + 1) * tenth;
            }
          } else if (j.step() > 0 || u.new_events_size() == 0) {
            out_ << ProgressLine(j, false) << "\n";
          }
        }
        out_.flush();
        final_state = j.state();
        final_message = j.message();
      }
      grpc::Status st = reader->Finish();
      if (drew_bar) {
        out_ << "\n";
        drew_bar = false;
      }
      if (IsTerminalState(final_state)) break;
      if (st.ok()) break;
      if (st.error_code() == grpc::StatusCode::UNAVAILABLE && retries_left-- > 0) {
        if (!reconnecting) {
          err_ << "spindle: watch: cannot reach the coordinator at " << o_.coordinator
               << "; retrying for up to " << retries_left + 1 << " s\n";
          reconnecting = true;
        }
        std::this_thread::sleep_for(std::chrono::seconds(1));
        continue;
      }
      return RpcFail(st);
    }
    if (!Json())
      out_ << id << " " << StateName(final_state)
           << (final_message.empty() ? "" : absl::StrCat(": ", final_message)) << "\n";
    if (final_state == v1::JOB_STATE_SUCCEEDED) return kExitOk;
    if (final_state == v1::JOB_STATE_FAILED || final_state == v1::JOB_STATE_CANCELLED)
      return kExitJobFailed;
    return kExitServerError;
  }

  int Watch() {
    int code;
    if (!OnePositional("JOB_ID", &code)) return code;
    return WatchJob(o_.positional[0]);
  }

  int Cancel() {
    int code;
    if (!OnePositional("JOB_ID", &code)) return code;
    v1::CancelJobRequest req;
    req.set_job_id(o_.positional[0]);
    req.set_reason(o_.reason);
    v1::CancelJobResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    grpc::Status st = v1::JobService::NewStub(Channel())->Cancel(&ctx, req, &resp);
    if (!st.ok()) return RpcFail(st);
    ForPrinting(&resp);
    if (Json()) {
      out_ << ToJsonLine(resp.job()) << "\n";
    } else if (resp.job().state() != v1::JOB_STATE_CANCELLED) {
      // The coordinator leaves a job that had already ended as it was.
      out_ << resp.job().job_id() << " had already " << StateName(resp.job().state())
           << "; nothing to cancel\n";
    } else {
      out_ << resp.job().job_id() << " " << StateName(resp.job().state()) << "\n";
    }
    return kExitOk;
  }

  int RevokeWorker() {
    if (o_.positional.size() != 2)
      return Fail(kExitUsage, "workers revoke: expected exactly one WORKER_ID");
    v1::RevokeWorkerRequest req;
    req.set_worker_id(o_.positional[1]);
    v1::RevokeWorkerResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    grpc::Status st = v1::ClusterService::NewStub(Channel())->RevokeWorker(&ctx, req, &resp);
    if (!st.ok()) return RpcFail(st);
    if (Json()) {
      out_ << ToJsonLine(resp) << "\n";
      return kExitOk;
    }
    out_ << "revoked " << resp.certificates_revoked() << " certificate"
         << (resp.certificates_revoked() == 1 ? "" : "s") << " of worker " << req.worker_id()
         << "; its sessions are ended\n";
    return kExitOk;
  }

  int Workers() {
    v1::ListWorkersRequest req;
    v1::ListWorkersResponse resp;
    grpc::ClientContext ctx;
    Prepare(&ctx);
    grpc::Status st = v1::ClusterService::NewStub(Channel())->ListWorkers(&ctx, req, &resp);
    if (!st.ok()) return RpcFail(st);
    ForPrinting(&resp);
    if (Json()) {
      out_ << ToJsonLine(resp) << "\n";
      return kExitOk;
    }
    out_ << absl::StrFormat("%-16s %-16s %-16s %-12s %-5s %-24s %9s %7s  %s\n", "WORKER", "HOST",
                            "ADDRESS", "STATE", "KIND", "DEVICE", "MEMORY", "USED", "RANKS");
    for (const v1::WorkerInfo& w : resp.workers()) {
      const v1::DeviceGroup g = w.devices_size() ? w.devices(0) : v1::DeviceGroup();
      out_ << absl::StrFormat(
          "%-16s %-16s %-16s %-12s %-5s %-24s %9s %7s  %s\n", w.worker_id(), w.hostname(),
          w.address(), w.state(), g.kind(), g.name().substr(0, 24), FormatBytes(g.memory_bytes()),
          absl::StrCat(w.used_slots(), "/", w.slots()), absl::StrJoin(w.ranks(), " "));
    }
    return kExitOk;
  }

  Options o_;
  std::ostream& out_;
  std::ostream& err_;
  bool tty_;
  std::string tls_ca_pem_;  // contents of --tls-ca, read once by Run()
  std::shared_ptr<grpc::Channel> channel_;
};

}  // namespace

int RunCli(const std::vector<std::string>& args, const std::map<std::string, std::string>& env,
           std::ostream& out, std::ostream& err, bool out_is_tty) {
  Options o;
  if (auto it = env.find("SPINDLE_COORDINATOR"); it != env.end() && !it->second.empty())
    o.coordinator = it->second;
  if (auto it = env.find("SPINDLE_TOKEN"); it != env.end()) o.token = it->second;
  if (auto it = env.find("SPINDLE_TLS_CA"); it != env.end()) o.tls_ca = it->second;
  o.trainer_binary = VerifyTrainerBinary(env);
  std::string error = ParseArgs(args, &o);
  if (error.empty()) {
    if (absl::Status a = CheckHostPort("--coordinator", o.coordinator); !a.ok())
      error = std::string(a.message());
  }
  if (o.help) {
    out << kUsage;
    return kExitOk;
  }
  if (!error.empty()) {
    err << "spindle: " << error << " (run spindle --help)\n";
    return kExitUsage;
  }
  if (o.command.empty()) {
    err << kUsage;
    return kExitUsage;
  }
  return Cli(std::move(o), out, err, out_is_tty).Run();
}

}  // namespace spindle
