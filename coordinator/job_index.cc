// The job manager's indexes over its jobs (see job_index.h).
#include "coordinator/job_index.h"

namespace spindle {

void JobIndex::Add(int64_t seq, const std::string& job_id, const std::string& checkpoint_place,
                   const std::string& request_id) {
  by_seq_[seq] = job_id;
  if (!checkpoint_place.empty()) by_place_[checkpoint_place].insert(job_id);
  if (!request_id.empty()) by_request_[request_id] = job_id;
}

void JobIndex::Remove(int64_t seq, const std::string& job_id, const std::string& checkpoint_place,
                      const std::string& request_id) {
  by_seq_.erase(seq);
  if (auto it = by_place_.find(checkpoint_place); it != by_place_.end()) {
    it->second.erase(job_id);
    if (it->second.empty()) by_place_.erase(it);
  }
  if (auto it = by_request_.find(request_id); it != by_request_.end() && it->second == job_id)
    by_request_.erase(it);
}

void JobIndex::VisitNewestFirst(
    int64_t before_seq, const std::function<bool(int64_t, const std::string&)>& visit) const {
  // Descending order: upper_bound is the first sequence number below before_seq.
  for (auto it = by_seq_.upper_bound(before_seq); it != by_seq_.end(); ++it)
    if (!visit(it->first, it->second)) break;
}

const std::set<std::string>& JobIndex::AtCheckpointPlace(const std::string& place) const {
  static const std::set<std::string> kNone;
  auto it = by_place_.find(place);
  return it == by_place_.end() ? kNone : it->second;
}

std::vector<std::string> JobIndex::OverlappingCheckpointPlace(const std::string& place) const {
  std::vector<std::string> out;
  auto add = [&](const std::set<std::string>& ids) {
    out.insert(out.end(), ids.begin(), ids.end());
  };
  // Ancestors: "/", then every prefix ending before a separator, then the place itself.
  if (place != "/") add(AtCheckpointPlace("/"));
  for (size_t at = place.find('/', 1); at != std::string::npos; at = place.find('/', at + 1))
    add(AtCheckpointPlace(place.substr(0, at)));
  add(AtCheckpointPlace(place));
  // Descendants: the keys from "<place>/" up to "<place>0" ('0' follows '/').
  const std::string base = place == "/" ? "" : place;
  for (auto it = by_place_.lower_bound(base + "/"); it != by_place_.end() && it->first < base + "0";
       ++it) {
    if (it->first != "/") add(it->second);
  }
  return out;
}

std::string JobIndex::ByRequestId(const std::string& request_id) const {
  auto it = by_request_.find(request_id);
  return it == by_request_.end() ? "" : it->second;
}

}  // namespace spindle
