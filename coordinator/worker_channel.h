// WorkerChannel: how the job manager talks to worker daemons. In the daemon it is the set of
// open Session streams; in unit tests a fake that records what was sent.
// Implementations must be thread-safe and must not block: Send only queues the message.
#pragma once

#include <string>

namespace spindle {
namespace v1 {
class CoordinatorMessage;
}  // namespace v1

class WorkerChannel {
 public:
  virtual ~WorkerChannel() = default;
  // Queues `msg` for the worker's open session. False when the worker has no open session (the
  // message is dropped; the manager's timeouts handle the consequences).
  virtual bool Send(const std::string& worker_id, const v1::CoordinatorMessage& msg) = 0;
};

}  // namespace spindle
