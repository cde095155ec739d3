// Host memory as this process may use it: what a worker offers (MemTotal) and what a trainer can
// still pin for offloaded layer inputs (MemAvailable), from /proc/meminfo, each capped by the
// memory limit of the process's cgroup (inside a container, the container's: a Kubernetes pod's
// limit, which /proc/meminfo does not show).
//
// Thread-safety: free functions; safe from any thread.
#pragma once

#include <cstdint>
#include <string_view>

namespace spindle {

// The bytes of the /proc/meminfo `field` ("MemTotal", "MemAvailable", ...) in `meminfo` text
// ("MemTotal:  131072 kB" lines); 0 when the field is missing or malformed.
int64_t MeminfoBytes(std::string_view meminfo, std::string_view field);

// The bytes of a cgroup memory file's text: cgroup v2's memory.max ("max" or a number) or
// memory.current, v1's memory.limit_in_bytes (a number; "no limit" is one near 2^63) or
// memory.usage_in_bytes. 0 for "max", a v1 "no limit", or text that is not a number.
int64_t CgroupBytes(std::string_view text);

// The value of `key` in a cgroup memory.stat text ("inactive_file 1234" lines); 0 when missing.
int64_t MemoryStatValue(std::string_view stat, std::string_view key);

// This machine's MemTotal, capped by the cgroup limit; 0 when unknown.
int64_t HostMemoryLimitBytes();
// This machine's MemAvailable, capped by what the cgroup limit leaves (the limit less the
// cgroup's working set: its usage without the inactive file cache); 0 when unknown.
int64_t HostMemoryAvailableBytes();

}  // namespace spindle
