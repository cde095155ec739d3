// Error-propagation helpers around absl::Status / absl::StatusOr.
// Abseil 20220623 (the Debian version) has no status macros of its own, so these are ours.
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define SPINDLE_CONCAT_INNER_(a, b) a##b
#define SPINDLE_CONCAT_(a, b) SPINDLE_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::absl::Status spindle_status_ = (expr);   \
    if (!spindle_status_.ok()) return spindle_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, MakeX());` unwraps an absl::StatusOr or returns its error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(SPINDLE_CONCAT_(spindle_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(tmp).value()
