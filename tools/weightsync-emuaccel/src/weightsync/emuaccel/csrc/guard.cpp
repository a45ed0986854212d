// Events and the device guard of the emulated accelerator: what torch.Stream, torch.Event, torch.accelerator and
// every DeviceGuard/StreamGuard reach. See emu.h for the model.
#include "emu.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <memory>

namespace weightsync_emu {

// ---------------------------------------------------------------------------------------------------- events

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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
    if (device.has_index()) {
      set_current_device_unchecked(device.index());
    }
  }
  c10::Stream getStream(c10::Device device) const override {
    return current_stream(index_of(device));
  }
  c10::Stream getDefaultStream(c10::Device device) const override {
    return default_stream(index_of(device));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*isHighPriority*/) const override {
    return pool_stream(index_of(device));
  }
  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    return new_stream(index_of(device));
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    return exchange_stream(stream);
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

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

}  // namespace weightsync_emu
