// SPDX-License-Identifier: Apache-2.0
// writescope/cuda/launch_thread.hpp — the launcher thread of an engine
// (basic_cuda_backend::set_launch_thread; docs/CUDA-ENGINE.md) and the
// backend's completion list of posted launches. Host compiler only.
//
// launch_thread: one job at a time handed from the thread that drives an
// engine to one worker thread, which runs the job's body (enqueueing CUDA work
// on the engine's device) and keeps what it threw for join(). The job's data
// lives with its owner: written before post(), read by the worker after it
// (the mutex orders them), and the worker's writes are read after join().
//
// completion_list: the backend's list of launch threads with a posted job.
// Every D2H into host blocks waits on h2d_done for the H2D reads before it
// (fault case C9), and h2d_done is recorded at the end of a launch's chunk
// loop, i.e. by the launcher; so those paths first join_all(). Typed: it holds
// launch_thread pointers, nothing type-erased, no virtual call.
//
// Threads: every member except the worker's loop is called from the thread
// that drives the backend. Errors: post() throws std::bad_alloc (before
// posting anything) when the list cannot grow; join() rethrows what the job
// threw (cuda_error).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "../detail/thread_affinity.hpp"

namespace writescope::cuda_detail {

class completion_list;

class launch_thread {
 public:
  explicit launch_thread(completion_list& list) noexcept : list_(&list) {}
  launch_thread(const launch_thread&) = delete;
  launch_thread& operator=(const launch_thread&) = delete;
  ~launch_thread() { stop(); }

  /// Starts the worker (once) on `device`; it runs body() for every posted
  /// job. False when no thread could be started, now or before: the caller
  /// then runs its jobs itself.
  template <class Body>
  bool start(int device, Body body) {
    if (thread_.joinable()) return true;
    if (refused_) return false;
    try {
      thread_ = std::thread([this, device, body]() mutable { serve(device, body); });
    } catch (...) {
      refused_ = true;
      return false;
    }
    return true;
  }

  /// Hands the job over and enters it in the completion list (reserved first:
  /// a throw leaves nothing posted). Only after start() returned true.
  inline void post();

  /// Whether a posted job has not been joined yet.
  [[nodiscard]] bool pending() const noexcept { return pending_; }

  /// Waits until the posted job has finished (no-op when none is pending) and
  /// rethrows what it threw.
  inline void join();

  /// Lets a posted job finish, then ends the worker.
  inline void stop() noexcept;

 private:
  template <class Body>
  void serve(int device, Body& body) {
    detail::widen_thread_affinity();  // not the creator's (possibly OpenMP-bound) core
    (void)cudaSetDevice(device);
    for (;;) {
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return stop_ || posted_; });
        if (!posted_) return;  // stop, nothing posted
      }
      std::exception_ptr err;
      try {
        body();
      } catch (...) {
        err = std::current_exception();
      }
      {
        std::lock_guard lk(mu_);
        posted_ = false;
        error_ = err;
      }
      cv_.notify_all();
    }
  }

  completion_list* list_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool posted_ = false;  // a job waits or runs
  std::exception_ptr error_;
  std::thread thread_;
  bool refused_ = false;
  bool pending_ = false;
};

class completion_list {
 public:
  /// Joins every pending launch, newest first.
  void join_all() {
    while (!pending_.empty()) {
      launch_thread* t = pending_.back();
      pending_.pop_back();
      t->join();
    }
  }

 private:
  friend class launch_thread;
  void reserve_one() { pending_.reserve(pending_.size() + 1); }
  void add(launch_thread& t) noexcept { pending_.push_back(&t); }  // after reserve_one: no allocation
  void forget(const launch_thread& t) noexcept { std::erase(pending_, &t); }

  std::vector<launch_thread*> pending_;
};

inline void launch_thread::post() {
  list_->reserve_one();  // may throw: before the post
  {
    std::lock_guard lk(mu_);
    posted_ = true;
  }
  cv_.notify_all();
  pending_ = true;
  list_->add(*this);
}

inline void launch_thread::join() {
  if (!pending_) return;
  pending_ = false;
  list_->forget(*this);
  std::unique_lock lk(mu_);
  cv_.wait(lk, [&] { return !posted_; });
  if (std::exception_ptr e = std::exchange(error_, nullptr)) {
    lk.unlock();
    std::rethrow_exception(e);
  }
}

inline void launch_thread::stop() noexcept {
  if (!thread_.joinable()) return;
  list_->forget(*this);
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();  // a posted job completes first
  pending_ = false;
}

}  // namespace writescope::cuda_detail
