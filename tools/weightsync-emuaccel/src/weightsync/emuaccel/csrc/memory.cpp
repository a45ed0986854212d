// Device memory (a memfd mapped twice per block, freed in stream order), pinned host memory and the PrivateUse1
// hooks of the emulated accelerator. See emu.h for the model.
#include "emu.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

namespace weightsync_emu {

namespace {

constexpr size_t kPageBytes = 4096;
// Freed blocks kept for reuse beyond this many bytes (per process) are unmapped once no stream can still use them.
constexpr size_t kCacheLimitBytes = size_t{256} << 20;

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
    mark_initialized();
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
    if (in_bad_fork()) {
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
  if (data_ptr.get_deleter() == &free_block) {
    return static_cast<Block*>(data_ptr.get_context());
  }
  // A storage that wraps device memory it does not own (at::from_blob on an emu pointer, as torch's legacy
  // serialization does): found by address among the live blocks.
  Block* block = find_block(data_ptr.get());
  TORCH_CHECK(block != nullptr, "emu: ", data_ptr.get(), " is not in any live emu allocation");
  return block;
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
  }
};
const Registration registration;

}  // namespace

}  // namespace weightsync_emu
