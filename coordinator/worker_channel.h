// WorkerChannel: how the job manager talks to worker daemons. In the daemon it is the set of
// open Session streams; in unit tests a fake that records what was sent.
// Implementations must be thread-safe and must not block: Send only queues the message.
#pragma once

#include <string>

#include "coordinator/worker_messages.h"

namespace spindle {

class WorkerChannel {
 public:
  virtual ~WorkerChannel() = default;
  // Queues `command` for the worker's open session. False when the worker has no open session (the
  // message is dropped; the manager's timeouts handle the consequences).
  virtual bool Send(const std::string& worker_id, const WorkerCommand& command) = 0;
};

}  // namespace spindle
