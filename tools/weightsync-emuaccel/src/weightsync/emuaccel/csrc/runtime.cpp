// Streams, events, device and pinned memory, the device guard and the PrivateUse1 hooks of the emulated
// accelerator. See emu.h for the model.
#include "emu.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

namespace weightsync_emu {

namespace {

constexpr size_t kPageBytes = 4096;
constexpr size_t kStreamPoolSize = 4;
// Freed blocks kept for reuse beyond this many bytes (per process) are unmapped once no stream can still use them.
constexpr size_t kCacheLimitBytes = size_t{256} << 20;

std::atomic<bool> g_workers_started{false};
std::atomic<bool> g_bad_fork{false};
std::atomic<double> g_copy_delay{0.0};
std::atomic<int64_t> g_synchronizations{0};

thread_local c10::DeviceIndex tls_device = 0;
thread_local std::array<c10::StreamId, kMaxDevices> tls_stream{};

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

void mark_fork_child() {
  if (g_workers_started.load()) {
    g_bad_fork.store(true);
  }
}

void check_not_forked() {
  TORCH_CHECK(
      !g_bad_fork.load(),
      "emu: cannot use the emulated device in a process forked after its parent started using it "
      "(its stream workers did not survive the fork); use the 'spawn' start method, as with CUDA");
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------- devices

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

bool in_bad_fork() {
  return g_bad_fork.load();
}

static c10::DeviceIndex index_of(const c10::Device& device) {
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
      g_workers_started.store(true);
      // Detached and never joined: the runtime lives until the process exits, like a driver's threads.
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
      work_ready_.wait(lock, [&] { return !queue_.empty(); });
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

static c10::Stream new_stream(c10::DeviceIndex device) {
  auto& streams = streams_of(device);
  std::lock_guard<std::mutex> lock(streams.mutex);
  return make_stream(device, streams.add_locked(device));
}

static c10::Stream pool_stream(c10::DeviceIndex device) {
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

// ---------------------------------------------------------------------------------------------------- events

namespace {

// An event is a position in one stream (the marker task queued by its last record) plus the time the marker ran.
struct Event {
  std::mutex mutex;
  Worker* worker = nullptr;
  uint64_t seq = 0;
  std::shared_ptr<std::atomic<int64_t>> time_ns;

  Fence snapshot() {
    std::lock_guard<std::mutex> lock(mutex);
    return Fence{worker, seq};
  }
};

int64_t wait_event_time(Event* event) {
  std::shared_ptr<std::atomic<int64_t>> time;
  Fence fence{nullptr, 0};
  {
    std::lock_guard<std::mutex> lock(event->mutex);
    fence = Fence{event->worker, event->seq};
    time = event->time_ns;
  }
  TORCH_CHECK(fence.worker != nullptr, "emu: elapsed_time needs both events recorded");
  fence.worker->wait(fence.seq);
  return time->load();
}

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return c10::DeviceType::PrivateUse1;
  }
  c10::Device exchangeDevice(c10::Device device) const override {
    const c10::DeviceIndex previous = current_device();
    set_current_device(index_of(device));
    return c10::Device(c10::DeviceType::PrivateUse1, previous);
  }
  c10::Device getDevice() const override {
    return c10::Device(c10::DeviceType::PrivateUse1, current_device());
  }
  void setDevice(c10::Device device) const override {
    set_current_device(index_of(device));
  }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.has_index() && device.index() >= 0 && device.index() < kMaxDevices) {
      tls_device = device.index();
    }
  }
  c10::Stream getStream(c10::Device device) const override {
    return current_stream(index_of(device));
  }
  c10::Stream getDefaultStream(c10::Device device) const override {
    return make_stream(index_of(device), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*isHighPriority*/) const override {
    return pool_stream(index_of(device));
  }
  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return new_stream(index_of(device));
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    worker(stream);  // validates it
    const c10::Stream previous = current_stream(stream.device_index());
    tls_stream[stream.device_index()] = stream.id();
    return previous;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    try {
      return device_count();
    } catch (...) {
      return 0;
    }
  }
  void destroyEvent(void* event, const c10::DeviceIndex /*device_index*/) const noexcept override {
    delete static_cast<Event*>(event);
  }
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag /*flag*/) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(), "emu: event device index ",
                static_cast<int>(device_index), " does not match the stream's device ", stream.device());
    auto* ev = static_cast<Event*>(*event);
    if (ev == nullptr) {
      ev = new Event();
      *event = ev;
    }
    Worker& w = worker(stream);
    auto stamp = std::make_shared<std::atomic<int64_t>>(0);
    const uint64_t seq = w.enqueue([stamp] { stamp->store(now_ns()); });
    std::lock_guard<std::mutex> lock(ev->mutex);
    ev->worker = &w;
    ev->seq = seq;
    ev->time_ns = std::move(stamp);
  }
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) {
      return;  // never recorded: nothing to wait for
    }
    const Fence fence = static_cast<Event*>(event)->snapshot();
    Worker& target = worker(stream);
    if (fence.worker == nullptr || fence.worker == &target) {
      return;  // a stream runs its own work in order
    }
    target.enqueue([fence] { fence.worker->wait_quietly(fence.seq); });
  }
  bool queryEvent(void* event) const override {
    if (event == nullptr) {
      return true;
    }
    const Fence fence = static_cast<Event*>(event)->snapshot();
    return fence.worker == nullptr || fence.worker->reached(fence.seq);
  }
  bool queryStream(const c10::Stream& stream) const override {
    Worker& w = worker(stream);
    return w.reached(w.enqueued());
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    Worker& w = worker(stream);
    w.wait(w.enqueued());
  }
  void synchronizeEvent(void* event) const override {
    if (event == nullptr) {
      return;
    }
    const Fence fence = static_cast<Event*>(event)->snapshot();
    if (fence.worker != nullptr) {
      fence.worker->wait(fence.seq);
    }
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    synchronize_device(device_index < 0 ? current_device() : device_index);
  }
  void recordDataPtrOnStream(const c10::DataPtr& data_ptr, const c10::Stream& stream) const override {
    device_allocator()->recordStream(data_ptr, stream);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*device_index*/) const override {
    TORCH_CHECK(start != nullptr && end != nullptr, "emu: elapsed_time needs both events recorded");
    const int64_t begin_ns = wait_event_time(static_cast<Event*>(start));
    const int64_t end_ns = wait_event_time(static_cast<Event*>(end));
    return static_cast<double>(end_ns - begin_ns) / 1e6;  // milliseconds, as CUDA
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------------- device memory

namespace {

bool passed(const std::vector<Fence>& fences) {
  return std::all_of(fences.begin(), fences.end(), [](const Fence& f) { return f.worker->reached(f.seq); });
}

std::vector<Fence> fences_now(const std::vector<Worker*>& workers) {
  std::vector<Fence> fences;
  fences.reserve(workers.size());
  for (Worker* w : workers) {
    fences.push_back(Fence{w, w->enqueued()});
  }
  return fences;
}

void free_block(void* ctx);

class DeviceMemory final : public c10::DeviceAllocator {
 public:
  DeviceMemory() : capacity_(static_cast<size_t>(env_int("WEIGHTSYNC_EMU_MEMORY_BYTES", int64_t{8} << 30))) {}

  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex device = current_device();
    const c10::Device where(c10::DeviceType::PrivateUse1, device);
    if (n == 0) {
      return c10::DataPtr(nullptr, where);
    }
    check_not_forked();
    const size_t bytes = (n + kPageBytes - 1) / kPageBytes * kPageBytes;
    Worker* stream = &current_worker(device);
    std::lock_guard<std::mutex> lock(mutex_);
    Block* block = take_cached_locked(bytes, device);
    if (block == nullptr) {
      block = map_locked(bytes, device);
    }
    block->alloc_stream = stream;
    block->recorded_streams.clear();
    live_[reinterpret_cast<uintptr_t>(block->device_ptr)] = block;
    auto& stats = stats_[device];
    stats.allocated += bytes;
    stats.peak = std::max(stats.peak, stats.allocated);
    return c10::DataPtr(block->device_ptr, block, &free_block, where);
  }

  void release(Block* block) {
    if (g_bad_fork.load()) {
      return;  // a forked child must not touch the parent's runtime: leak
    }
    std::vector<Worker*> reuse{block->alloc_stream};
    reuse.insert(reuse.end(), block->recorded_streams.begin(), block->recorded_streams.end());
    block->reuse_fence = fences_now(reuse);
    block->unmap_fence = fences_now(all_workers());
    std::lock_guard<std::mutex> lock(mutex_);
    live_.erase(reinterpret_cast<uintptr_t>(block->device_ptr));
    stats_[block->device].allocated -= block->bytes;
    cached_.emplace(block->bytes, block);
    cached_bytes_ += block->bytes;
    trim_locked(kCacheLimitBytes);
  }

  Block* find(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = live_.upper_bound(reinterpret_cast<uintptr_t>(ptr));
    if (it == live_.begin()) {
      return nullptr;
    }
    --it;
    Block* block = it->second;
    const auto* p = static_cast<const char*>(ptr);
    return p < block->device_ptr + block->bytes ? block : nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count == 0) {
      return;
    }
    auto* self = const_cast<DeviceMemory*>(this);
    Block* to = self->find(dest);
    Block* from = self->find(src);
    TORCH_CHECK(to != nullptr && from != nullptr, "emu: copy_data needs two emu device pointers");
    char* d = to->worker_ptr + (static_cast<char*>(dest) - to->device_ptr);
    const char* s = from->worker_ptr + (static_cast<const char*>(src) - from->device_ptr);
    Worker& w = current_worker(to->device);
    w.wait(w.enqueue([d, s, count, delay = copy_delay()] {
      sleep_seconds(delay);
      std::memcpy(d, s, count);
    }));
  }

  bool initialized() override {
    return true;
  }
  void emptyCache(c10::MempoolId_t /*mempool_id*/) override {
    std::lock_guard<std::mutex> lock(mutex_);
    trim_locked(0);
  }
  void recordStream(const c10::DataPtr& data_ptr, c10::Stream stream) override {
    Block* block = block_of(data_ptr);
    if (block == nullptr) {
      return;  // an empty allocation
    }
    Worker* w = &worker(stream);
    std::lock_guard<std::mutex> lock(mutex_);
    if (w != block->alloc_stream &&
        std::find(block->recorded_streams.begin(), block->recorded_streams.end(), w) ==
            block->recorded_streams.end()) {
      block->recorded_streams.push_back(w);
    }
  }
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(mutex_);
    c10::CachingDeviceAllocator::DeviceStats stats;
    auto& bytes = stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    bytes.current = static_cast<int64_t>(stats_[device].allocated);
    bytes.peak = static_cast<int64_t>(stats_[device].peak);
    auto& reserved = stats.reserved_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)];
    reserved.current = static_cast<int64_t>(stats_[device].mapped);
    return stats;
  }
  void resetAccumulatedStats(c10::DeviceIndex /*device*/) override {}
  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_[device].peak = stats_[device].allocated;
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(mutex_);
    return {capacity_ - std::min(capacity_, stats_[device].mapped), capacity_};
  }

 private:
  struct Stats {
    size_t allocated = 0;
    size_t peak = 0;
    size_t mapped = 0;
  };

  Block* take_cached_locked(size_t bytes, c10::DeviceIndex device) {
    auto range = cached_.equal_range(bytes);
    for (auto it = range.first; it != range.second; ++it) {
      Block* block = it->second;
      if (block->device == device && passed(block->reuse_fence)) {
        cached_.erase(it);
        cached_bytes_ -= bytes;
        return block;
      }
    }
    return nullptr;
  }

  Block* map_locked(size_t bytes, c10::DeviceIndex device) {
    if (stats_[device].mapped + bytes > capacity_) {
      trim_locked(0);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, stats_[device].mapped + bytes <= capacity_, "emu: out of memory on device ",
                     static_cast<int>(device), ": tried to allocate ", bytes, " bytes with ", stats_[device].mapped,
                     " of ", capacity_, " bytes in use (WEIGHTSYNC_EMU_MEMORY_BYTES sets the capacity)");
    const int fd = memfd_create("weightsync-emu", MFD_CLOEXEC);
    TORCH_CHECK(fd >= 0, "emu: memfd_create failed: ", std::strerror(errno));
    void* device_ptr = MAP_FAILED;
    void* worker_ptr = MAP_FAILED;
    if (ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
      device_ptr = mmap(nullptr, bytes, PROT_NONE, MAP_SHARED, fd, 0);
      worker_ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    const int error = errno;
    close(fd);  // the two mappings keep the pages
    if (device_ptr == MAP_FAILED || worker_ptr == MAP_FAILED) {
      if (device_ptr != MAP_FAILED) {
        munmap(device_ptr, bytes);
      }
      if (worker_ptr != MAP_FAILED) {
        munmap(worker_ptr, bytes);
      }
      TORCH_CHECK_WITH(OutOfMemoryError, false, "emu: cannot map ", bytes, " bytes: ", std::strerror(error));
    }
    auto* block = new Block();
    block->device_ptr = static_cast<char*>(device_ptr);
    block->worker_ptr = static_cast<char*>(worker_ptr);
    block->bytes = bytes;
    block->device = device;
    stats_[device].mapped += bytes;
    return block;
  }

  // Unmaps cached blocks that no stream can still touch until at most `limit` cached bytes remain.
  void trim_locked(size_t limit) {
    for (auto it = cached_.begin(); it != cached_.end() && cached_bytes_ > limit;) {
      Block* block = it->second;
      if (!passed(block->unmap_fence)) {
        ++it;
        continue;
      }
      munmap(block->device_ptr, block->bytes);
      munmap(block->worker_ptr, block->bytes);
      stats_[block->device].mapped -= block->bytes;
      cached_bytes_ -= block->bytes;
      delete block;
      it = cached_.erase(it);
    }
  }

  const size_t capacity_;
  std::mutex mutex_;
  std::map<uintptr_t, Block*> live_;
  std::multimap<size_t, Block*> cached_;
  size_t cached_bytes_ = 0;
  std::array<Stats, kMaxDevices> stats_{};
};

DeviceMemory& memory() {
  static auto* instance = new DeviceMemory();
  return *instance;
}

void free_block(void* ctx) {
  memory().release(static_cast<Block*>(ctx));
}

}  // namespace

c10::DeviceAllocator* device_allocator() {
  return &memory();
}

Block* block_of(const c10::DataPtr& data_ptr) {
  if (data_ptr.get() == nullptr) {
    return nullptr;
  }
  TORCH_CHECK(data_ptr.get_deleter() == &free_block, "emu: this storage was not allocated by the emu allocator");
  return static_cast<Block*>(data_ptr.get_context());
}

Block* find_block(const void* ptr) {
  return memory().find(ptr);
}

void resize_storage_bytes(c10::StorageImpl* storage, size_t bytes) {
  TORCH_CHECK(storage->resizable(), "emu: trying to resize a storage that is not resizable");
  const c10::DeviceIndex device = storage->device().index();
  const c10::DeviceIndex previous = current_device();
  set_current_device(device);
  c10::DataPtr fresh = memory().allocate(bytes);
  set_current_device(previous);
  const size_t keep = std::min(bytes, storage->nbytes());
  if (keep > 0) {
    Block* from = block_of(storage->data_ptr());
    Block* to = block_of(fresh);
    const char* src = from->worker_ptr + (static_cast<const char*>(storage->data()) - from->device_ptr);
    char* dst = to->worker_ptr;
    current_worker(device).enqueue([src, dst, keep, delay = copy_delay()] {
      sleep_seconds(delay);
      std::memcpy(dst, src, keep);
    });
    // The old block must outlive the copy just queued, whichever stream it was allocated on.
    memory().recordStream(storage->data_ptr(), current_stream(device));
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(bytes);
}

// ---------------------------------------------------------------------------------------------------- pinned memory

namespace {

// Pinned host memory is ordinary host memory that the emulator knows about: a copy between it and the device may
// return before it has run (non_blocking), as with cudaHostAlloc'd memory; a copy with any other host memory waits.
class PinnedMemory final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
    }
    void* ptr = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK_WITH(OutOfMemoryError, ptr != MAP_FAILED, "emu: cannot allocate ", n, " bytes of pinned memory: ",
                     std::strerror(errno));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ranges_[reinterpret_cast<uintptr_t>(ptr)] = n;
    }
    return c10::DataPtr(ptr, ptr, &free_pinned, c10::Device(c10::DeviceType::CPU));
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &free_pinned;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
  bool contains(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = ranges_.upper_bound(reinterpret_cast<uintptr_t>(ptr));
    if (it == ranges_.begin()) {
      return false;
    }
    --it;
    return reinterpret_cast<uintptr_t>(ptr) < it->first + it->second;
  }
  void release(void* ptr) {
    size_t n = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = ranges_.find(reinterpret_cast<uintptr_t>(ptr));
      if (it == ranges_.end()) {
        return;
      }
      n = it->second;
      ranges_.erase(it);
    }
    munmap(ptr, n);
  }

 private:
  static void free_pinned(void* ptr);
  std::mutex mutex_;
  std::map<uintptr_t, size_t> ranges_;
};

PinnedMemory& pinned() {
  static auto* instance = new PinnedMemory();
  return *instance;
}

void PinnedMemory::free_pinned(void* ptr) {
  if (ptr != nullptr) {
    pinned().release(ptr);
  }
}

}  // namespace

c10::Allocator* pinned_allocator() {
  return &pinned();
}

bool is_pinned_ptr(const void* ptr) {
  return ptr != nullptr && pinned().contains(ptr);
}

// ---------------------------------------------------------------------------------------------------- hooks

namespace {

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override {
    return true;
  }
  bool isAvailable() const override {
    return true;
  }
  bool hasPrimaryContext(c10::DeviceIndex /*device_index*/) const override {
    return true;
  }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override {
    return device_count();
  }
  void setCurrentDevice(c10::DeviceIndex device) const override {
    set_current_device(device);
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return current_device();
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex device) const override {
    const c10::DeviceIndex previous = current_device();
    if (device >= 0) {
      set_current_device(device);
    }
    return previous;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex device) const override {
    return exchangeDevice(device);
  }
  bool isPinnedPtr(const void* data) const override {
    return is_pinned_ptr(data);
  }
  at::Allocator* getPinnedMemoryAllocator() const override {
    return pinned_allocator();
  }
  at::Device getDeviceFromPtr(void* data) const override {
    Block* block = find_block(data);
    TORCH_CHECK(block != nullptr, "emu: ", data, " is not an emu device pointer");
    return at::Device(c10::DeviceType::PrivateUse1, block->device);
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), newsize);
  }
};

struct Registration {
  Registration() {
    static Hooks hooks;
    at::RegisterPrivateUse1HooksInterface(&hooks);
    c10::SetAllocator(c10::DeviceType::PrivateUse1, device_allocator());
    pthread_atfork(nullptr, nullptr, &mark_fork_child);
  }
};
const Registration registration;

}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

}  // namespace weightsync_emu
