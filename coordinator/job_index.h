// JobIndex: the job manager's lookups that must not scan every stored job, so that Submit and
// List cost the same with ten jobs or a hundred thousand: jobs by submission order (List
// pages), jobs by checkpoint directory (Submit's check that no two unfinished jobs share one)
// and jobs by client request id (idempotent Submit). It holds job ids only; the manager adds a
// job when it creates or recovers it and removes it when the job is pruned.
// Thread-safety: none; the job manager guards it with its mutex.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace spindle {

class JobIndex {
 public:
  // `checkpoint_place`: the job's checkpoint directory as a comparable path ("" for none);
  // `request_id`: "" for none.
  void Add(int64_t seq, const std::string& job_id, const std::string& checkpoint_place,
           const std::string& request_id);
  // Removes what Add added with the same arguments.
  void Remove(int64_t seq, const std::string& job_id, const std::string& checkpoint_place,
              const std::string& request_id);

  // Calls `visit(seq, job_id)` for the jobs with a sequence number below `before_seq`, newest
  // first, until it returns false.
  void VisitNewestFirst(int64_t before_seq,
                        const std::function<bool(int64_t, const std::string&)>& visit) const;
  // The jobs (finished or not) whose checkpoint directory is `place`.
  const std::set<std::string>& AtCheckpointPlace(const std::string& place) const;
  // The jobs (finished or not) whose checkpoint directory is `place`, one of its ancestors or
  // inside it ("/a/b" overlaps "/", "/a", "/a/b" and "/a/b/c", not "/a/bc"): one lookup per
  // ancestor and one range of the sorted index, not a scan of every job. `place` is absolute.
  std::vector<std::string> OverlappingCheckpointPlace(const std::string& place) const;
  // The job a request id created; "" when none.
  std::string ByRequestId(const std::string& request_id) const;

  size_t size() const { return by_seq_.size(); }

 private:
  std::map<int64_t, std::string, std::greater<>> by_seq_;
  std::map<std::string, std::set<std::string>> by_place_;
  std::map<std::string, std::string> by_request_;
};

}  // namespace spindle
