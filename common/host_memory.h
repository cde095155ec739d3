// Host memory as Linux reports it in /proc/meminfo: what a worker offers (MemTotal) and what a
// trainer can still pin for offloaded layer inputs (MemAvailable).
//
// Thread-safety: free functions; safe from any thread.
#pragma once

#include <cstdint>
#include <string_view>

namespace spindle {

// The bytes of the /proc/meminfo `field` ("MemTotal", "MemAvailable", ...) in `meminfo` text
// ("MemTotal:  131072 kB" lines); 0 when the field is missing or malformed.
int64_t MeminfoBytes(std::string_view meminfo, std::string_view field);

// MeminfoBytes of this machine's /proc/meminfo; 0 where there is none.
int64_t HostMemoryBytes(std::string_view field);

}  // namespace spindle
