// The emulated accelerator's runtime, shared by its four translation units:
//   streams.cpp  devices, streams (one worker thread each), the copy delay, device-wide synchronization;
//   guard.cpp    events and the device guard (torch.Stream, torch.Event, torch.accelerator, DeviceGuard);
//   memory.cpp   device memory, pinned host memory and the PrivateUse1 hooks;
//   ops.cpp      the ATen kernels registered for PrivateUse1 (allocation, views, copies, fill) and the
//                weightsync_emu:: operators the Python package calls.
//
// The model is CUDA's, reduced to what a test of data movement can observe:
//   * Device memory is not host memory. Every block is one memfd mapped twice: the address handed to torch (a
//     tensor's data_ptr) lies in a PROT_NONE mapping, so a host read through it faults; the stream workers reach
//     the same pages through a second, read-write mapping at the same offset.
//   * Work is asynchronous. Each stream is a FIFO queue drained by a thread of its own; copies, fills and event
//     markers are queued there, and the host only waits where CUDA would (a copy from or to pageable memory, a
//     blocking copy, a synchronize).
//   * Frees are stream-ordered: a freed block is reused only once the work queued before the free on its
//     allocation stream (and on every stream recorded with record_stream) has run.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace weightsync_emu {

constexpr int kMaxDevices = 16;

// Number of emulated devices: WEIGHTSYNC_EMU_DEVICE_COUNT (1 to 16), read once; 1 by default.
c10::DeviceIndex device_count();
void check_device(c10::DeviceIndex device);
c10::DeviceIndex current_device();
void set_current_device(c10::DeviceIndex device);
void set_current_device_unchecked(c10::DeviceIndex device) noexcept;
// The index of an emu device; a device without one is the current device.
c10::DeviceIndex index_of(const c10::Device& device);

// True in a child forked after its parent used the device (allocated memory or queued work): like CUDA, the
// emulator refuses to run there (its worker threads did not survive the fork, and its memory would be shared with
// the parent's). Use the 'spawn' start method. check_not_forked raises there.
bool in_bad_fork();
void check_not_forked();
void mark_initialized();

// An integer environment variable, or `fallback` when it is unset or empty.
int64_t env_int(const char* name, int64_t fallback);

// One stream: a FIFO of tasks run in order on a thread of its own, started on the first task.
class Worker {
 public:
  Worker(c10::DeviceIndex device, c10::StreamId id);
  // Queues a task; returns its sequence number (1, 2, ...).
  uint64_t enqueue(std::function<void()> task);
  // The sequence number of the last task queued so far (0: none).
  uint64_t enqueued();
  bool reached(uint64_t seq) const {
    return completed_.load(std::memory_order_acquire) >= seq;
  }
  // Blocks the calling thread until task `seq` has run. The host-facing form rethrows (once) an error that a task
  // raised on the worker, as CUDA reports an asynchronous error at the next synchronization.
  void wait(uint64_t seq);
  void wait_quietly(uint64_t seq);
  c10::DeviceIndex device() const {
    return device_;
  }
  c10::StreamId id() const {
    return id_;
  }

 private:
  void run();

  const c10::DeviceIndex device_;
  const c10::StreamId id_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable work_done_;
  std::deque<std::pair<uint64_t, std::function<void()>>> queue_;
  uint64_t enqueued_ = 0;
  std::atomic<uint64_t> completed_{0};
  std::string error_;
  bool started_ = false;
};

// A stream's worker (stream id 0 is the device's default stream).
Worker& worker(const c10::Stream& stream);
Worker& current_worker(c10::DeviceIndex device);
c10::Stream current_stream(c10::DeviceIndex device);
c10::Stream default_stream(c10::DeviceIndex device);
// A new stream of its own (torch.Stream), or one of a small pool shared round-robin (getStreamFromGlobalPool).
c10::Stream new_stream(c10::DeviceIndex device);
c10::Stream pool_stream(c10::DeviceIndex device);
// Makes `stream` the calling thread's current stream of its device; returns the previous one.
c10::Stream exchange_stream(const c10::Stream& stream);
// Every worker created so far, on every device.
std::vector<Worker*> all_workers();

// The injected delay (seconds) that every device copy sleeps on its worker before moving bytes. A copy takes the
// value in force when it is queued.
void set_copy_delay(double seconds);
double copy_delay();
void sleep_seconds(double seconds);

// Device-wide synchronization: waits for every stream of the device and counts the call.
void synchronize_device(c10::DeviceIndex device);
int64_t synchronizations();

// A position in one stream: passed once that stream has run task `seq`.
struct Fence {
  Worker* worker;
  uint64_t seq;
};

// One device allocation: a memfd mapped twice.
struct Block {
  char* device_ptr = nullptr;  // PROT_NONE: the address torch sees
  char* worker_ptr = nullptr;  // PROT_READ|PROT_WRITE: the same pages, for the stream workers
  size_t bytes = 0;
  c10::DeviceIndex device = 0;
  Worker* alloc_stream = nullptr;
  std::vector<Worker*> recorded_streams;
  std::vector<Fence> reuse_fence;  // set at free: the block may be handed out again once all have passed
  std::vector<Fence> unmap_fence;  // every stream at free: the pages may be unmapped once all have passed
};

// The device allocator (registered for PrivateUse1).
c10::DeviceAllocator* device_allocator();
// The block a device storage lies in (its own, or the live block containing it for a storage that wraps device
// memory it does not own).
Block* block_of(const c10::DataPtr& data_ptr);
// The block containing `ptr` (a device address), or nullptr.
Block* find_block(const void* ptr);
// Resizes a device storage to `bytes`, keeping min(old, new) bytes (copied on the current stream).
void resize_storage_bytes(c10::StorageImpl* storage, size_t bytes);

// The pinned host allocator and its membership test.
c10::Allocator* pinned_allocator();
bool is_pinned_ptr(const void* ptr);

}  // namespace weightsync_emu
