// Where a job's files are, and whether a path lies under a root, by the path's text alone: the
// rules the coordinator applies at submit against the roots each worker reported at registration
// (it cannot see the workers' filesystems), and the first half of the worker's own check before a
// rank starts (worker/path_roots.h, which also resolves symbolic links).
// Pure functions; no thread-safety concerns.
#pragma once

#include <string>

#include "common/job_spec.h"

namespace spindle {

// The file a data source reads ("tokens:<path>" or "text:<path>"); "" for synthetic data.
std::string DataSourceFile(const DataSpec& data);

// Whether `path` is absolute, has no ".." component and, component by component, lies in `root`
// (or is it). A trailing separator of either does not count.
bool LexicallyWithin(const std::string& path, const std::string& root);

// Whether `path` has a ".." component.
bool HasDotDotComponent(const std::string& path);

}  // namespace spindle
