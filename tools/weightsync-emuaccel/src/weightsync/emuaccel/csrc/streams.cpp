// Devices and streams (a worker thread each) of the emulated accelerator, the injected copy delay and the counted
// device-wide synchronization. See emu.h for the model.
#include "emu.h"

#include <c10/util/Exception.h>

#include <pthread.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>

namespace weightsync_emu {

namespace {

constexpr size_t kStreamPoolSize = 4;
// A worker thread with nothing queued for this long exits; the next task starts a new one. So a program that makes
// a stream per transfer does not accumulate threads.
constexpr auto kWorkerIdle = std::chrono::seconds(2);

std::atomic<bool> g_initialized{false};
std::atomic<bool> g_bad_fork{false};
std::atomic<double> g_copy_delay{0.0};
std::atomic<int64_t> g_synchronizations{0};

thread_local c10::DeviceIndex tls_device = 0;
thread_local std::array<c10::StreamId, kMaxDevices> tls_stream{};

}  // namespace

// ---------------------------------------------------------------------------------------------------- devices

int64_t env_int(const char* name, int64_t fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') {
    return fallback;
  }
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  TORCH_CHECK(end != text && *end == '\0', "emu: ", name, " must be an integer, got '", text, "'");
  return value;
}

void check_not_forked() {
  TORCH_CHECK(
      !g_bad_fork.load(),
      "emu: cannot use the emulated device in a process forked after its parent started using it "
      "(its stream workers did not survive the fork, its memory is the parent's); use the 'spawn' start method, "
      "as with CUDA");
}

void mark_initialized() {
  g_initialized.store(true);
}

static void mark_fork_child() {
  if (g_initialized.load()) {
    g_bad_fork.store(true);
  }
}

c10::DeviceIndex device_count() {
  static const c10::DeviceIndex count = [] {
    const int64_t value = env_int("WEIGHTSYNC_EMU_DEVICE_COUNT", 1);
    TORCH_CHECK(value >= 1 && value <= kMaxDevices, "emu: WEIGHTSYNC_EMU_DEVICE_COUNT must be 1 to ", kMaxDevices);
    return static_cast<c10::DeviceIndex>(value);
  }();
  return count;
}

void check_device(c10::DeviceIndex device) {
  TORCH_CHECK(
      device >= 0 && device < device_count(), "emu: invalid device index ", static_cast<int>(device),
      " (this process has ", static_cast<int>(device_count()), " emu device(s))");
}

c10::DeviceIndex current_device() {
  return tls_device;
}

void set_current_device(c10::DeviceIndex device) {
  check_device(device);
  tls_device = device;
}

void set_current_device_unchecked(c10::DeviceIndex device) noexcept {
  if (device >= 0 && device < kMaxDevices) {
    tls_device = device;
  }
}

bool in_bad_fork() {
  return g_bad_fork.load();
}

c10::DeviceIndex index_of(const c10::Device& device) {
  const c10::DeviceIndex index = device.has_index() ? device.index() : current_device();
  check_device(index);
  return index;
}

// ---------------------------------------------------------------------------------------------------- streams

Worker::Worker(c10::DeviceIndex device, c10::StreamId id) : device_(device), id_(id) {}

uint64_t Worker::enqueue(std::function<void()> task) {
  check_not_forked();
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!started_) {
      started_ = true;
      mark_initialized();
      // Detached and never joined: it exits when idle (see kWorkerIdle) or with the process.
      std::thread([this] { run(); }).detach();
    }
    seq = ++enqueued_;
    queue_.emplace_back(seq, std::move(task));
  }
  work_ready_.notify_one();
  return seq;
}

uint64_t Worker::enqueued() {
  std::lock_guard<std::mutex> lock(mutex_);
  return enqueued_;
}

void Worker::wait_quietly(uint64_t seq) {
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [&] { return completed_.load(std::memory_order_acquire) >= seq; });
}

void Worker::wait(uint64_t seq) {
  std::unique_lock<std::mutex> lock(mutex_);
  work_done_.wait(lock, [&] { return completed_.load(std::memory_order_acquire) >= seq; });
  if (!error_.empty()) {
    const std::string error = std::move(error_);
    error_.clear();
    TORCH_CHECK(false, "emu: asynchronous error on stream ", id_, " of device ", static_cast<int>(device_), ": ",
                error);
  }
}

void Worker::run() {
  const std::string name = "emu" + std::to_string(device_) + "s" + std::to_string(id_);
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
  for (;;) {
    std::pair<uint64_t, std::function<void()>> item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (!work_ready_.wait_for(lock, kWorkerIdle, [&] { return !queue_.empty(); })) {
        started_ = false;  // under the lock: the next enqueue starts a new thread
        return;
      }
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string error;
    try {
      item.second();
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      error = e.what();
    }
    item.second = nullptr;  // release what the task held (host storages) before it counts as done
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error.empty() && error_.empty()) {
        error_ = std::move(error);
      }
      completed_.store(item.first, std::memory_order_release);
    }
    work_done_.notify_all();
  }
}

namespace {

struct DeviceStreams {
  std::mutex mutex;
  std::vector<Worker*> workers;  // index: stream id; 0 is the default stream
  std::vector<c10::StreamId> pool;
  size_t next_pool = 0;

  Worker* default_locked(c10::DeviceIndex device) {
    if (workers.empty()) {
      workers.push_back(new Worker(device, 0));
    }
    return workers[0];
  }
  c10::StreamId add_locked(c10::DeviceIndex device) {
    default_locked(device);
    const auto id = static_cast<c10::StreamId>(workers.size());
    workers.push_back(new Worker(device, id));
    return id;
  }
};

DeviceStreams& streams_of(c10::DeviceIndex device) {
  check_device(device);
  static auto* all = new std::array<DeviceStreams, kMaxDevices>();
  return (*all)[device];
}

c10::Stream make_stream(c10::DeviceIndex device, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(c10::DeviceType::PrivateUse1, device), id);
}

}  // namespace

Worker& worker(const c10::Stream& stream) {
  TORCH_CHECK(stream.device_type() == c10::DeviceType::PrivateUse1, "emu: not an emu stream: ", stream);
  auto& streams = streams_of(stream.device_index());
  std::lock_guard<std::mutex> lock(streams.mutex);
  streams.default_locked(stream.device_index());
  TORCH_CHECK(
      stream.id() >= 0 && static_cast<size_t>(stream.id()) < streams.workers.size(), "emu: unknown stream ",
      stream.id(), " on device ", static_cast<int>(stream.device_index()));
  return *streams.workers[stream.id()];
}

c10::Stream current_stream(c10::DeviceIndex device) {
  check_device(device);
  return make_stream(device, tls_stream[device]);
}

c10::Stream default_stream(c10::DeviceIndex device) {
  check_device(device);
  return make_stream(device, 0);
}

c10::Stream exchange_stream(const c10::Stream& stream) {
  worker(stream);  // validates it
  const c10::Stream previous = current_stream(stream.device_index());
  tls_stream[stream.device_index()] = stream.id();
  return previous;
}

Worker& current_worker(c10::DeviceIndex device) {
  return worker(current_stream(device));
}

std::vector<Worker*> all_workers() {
  std::vector<Worker*> result;
  for (c10::DeviceIndex device = 0; device < device_count(); ++device) {
    auto& streams = streams_of(device);
    std::lock_guard<std::mutex> lock(streams.mutex);
    result.insert(result.end(), streams.workers.begin(), streams.workers.end());
  }
  return result;
}

c10::Stream new_stream(c10::DeviceIndex device) {
  auto& streams = streams_of(device);
  std::lock_guard<std::mutex> lock(streams.mutex);
  return make_stream(device, streams.add_locked(device));
}

c10::Stream pool_stream(c10::DeviceIndex device) {
  auto& streams = streams_of(device);
  std::lock_guard<std::mutex> lock(streams.mutex);
  if (streams.pool.empty()) {
    for (size_t i = 0; i < kStreamPoolSize; ++i) {
      streams.pool.push_back(streams.add_locked(device));
    }
  }
  const c10::StreamId id = streams.pool[streams.next_pool++ % streams.pool.size()];
  return make_stream(device, id);
}

void set_copy_delay(double seconds) {
  TORCH_CHECK(seconds >= 0.0, "emu: the copy delay must be >= 0 seconds, got ", seconds);
  g_copy_delay.store(seconds);
}

double copy_delay() {
  return g_copy_delay.load();
}

void sleep_seconds(double seconds) {
  if (seconds > 0.0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
}

void synchronize_device(c10::DeviceIndex device) {
  check_device(device);
  g_synchronizations.fetch_add(1);
  std::vector<Worker*> workers;
  {
    auto& streams = streams_of(device);
    std::lock_guard<std::mutex> lock(streams.mutex);
    workers = streams.workers;
  }
  for (Worker* w : workers) {
    w->wait(w->enqueued());
  }
}

int64_t synchronizations() {
  return g_synchronizations.load();
}


namespace {
struct ForkHandler {
  ForkHandler() {
    pthread_atfork(nullptr, nullptr, &mark_fork_child);
  }
};
const ForkHandler fork_handler;
}  // namespace

}  // namespace weightsync_emu
