// SPDX-License-Identifier: Apache-2.0
// writescope/error.hpp — the one error model of the library (docs/ERRORS.md).
//
// Every failure the library detects is thrown as a type derived from
// writescope::error, with a message that names the offending value and the rule
// it broke. Operations that throw leave the cache as it was (strong guarantee)
// unless their documentation says otherwise. docs/ERRORS.md lists which call
// throws what.
#pragma once

#include <stdexcept>
#include <string>

#include "config.hpp"

namespace writescope {

/// Base of every exception thrown by writescope.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A configuration that can never work: unsupported head dim, Hq not a multiple
/// of Hkv, D not a multiple of the block size, a policy parameter out of range.
class config_error : public error {
 public:
  using error::error;
};

/// An argument whose shape or size does not match what the call requires
/// (wrong span sizes, a layer index out of range, an unknown sequence).
class shape_error : public error {
 public:
  using error::error;
};

/// A call that is valid in general but not in the cache's current state
/// (append to a full D-window before flush, prefill twice).
class state_error : public error {
 public:
  using error::error;
};

/// A region or pool would exceed the capacity fixed at init.
class capacity_error : public error {
 public:
  using error::error;
};

/// A memory resource was refused by the system (pinned memory, device memory,
/// host memory), always at init or at region growth, never mid-step.
class resource_error : public error {
 public:
  using error::error;
};

/// Page-locking (cudaHostAlloc / cudaHostRegister / mlock) was refused.
class pinned_memory_error : public resource_error {
 public:
  using resource_error::resource_error;
};

/// A CUDA runtime call failed; the message names the call, the error code and
/// the source location.
class cuda_error : public error {
 public:
  cuda_error(const std::string& what, int code) : error(what), code_(code) {}
  [[nodiscard]] int code() const noexcept { return code_; }

 private:
  int code_;
};

/// A checkpoint or config file is missing, truncated or malformed.
class checkpoint_error : public error {
 public:
  using error::error;
};

namespace detail {

/// Builds "<where>: <what>" messages; kept out of line of hot paths.
template <class Error>
[[noreturn]] inline void raise(const std::string& what) {
  throw Error(what);
}

/// Throws Error(message) when `cond` is false.
template <class Error>
inline void require(bool cond, const std::string& message) {
  if (!cond) raise<Error>(message);
}

}  // namespace detail
}  // namespace writescope
