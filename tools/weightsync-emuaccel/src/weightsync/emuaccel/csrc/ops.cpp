// The ATen kernels of the emulated accelerator (dispatch key PrivateUse1) and the weightsync_emu:: operators that
// the Python package calls. Only what moves or describes memory is implemented here: allocation, views, resize,
// set_, copies in every direction, fill and reading one scalar. Every other operator runs through torch's CPU
// fallback, which copies its device inputs to the host through these copies, runs the CPU kernel and copies the
// results back.
#include "emu.h"

#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_local_scalar_dense.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <cstring>

namespace weightsync_emu {
namespace {

// What a stream worker needs to reach a tensor's elements: the address of its first element (through the
// worker's read-write alias for device memory) and its geometry. Captured by value when the work is queued.
struct View {
  char* base = nullptr;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  c10::ScalarType dtype = c10::ScalarType::Byte;
  bool conj = false;
  bool neg = false;
  bool dense = false;  // contiguous, no lazy conj/neg: a plain memcpy can move it
  size_t nbytes = 0;

  at::Tensor tensor() const {
    at::Tensor t = at::from_blob(base, sizes, strides, at::TensorOptions().dtype(dtype));
    if (conj) {
      t = t._conj();
    }
    if (neg) {
      t = t._neg_view();
    }
    return t;
  }
};

View describe(const at::Tensor& t, bool writable) {
  View v;
  char* ptr = writable ? static_cast<char*>(t.data_ptr()) : static_cast<char*>(const_cast<void*>(t.const_data_ptr()));
  if (t.is_privateuseone()) {
    const Block* block = block_of(t.storage().data_ptr());
    v.base = block->worker_ptr + (ptr - block->device_ptr);
  } else {
    v.base = ptr;
  }
  v.sizes = t.sizes().vec();
  v.strides = t.strides().vec();
  v.dtype = t.scalar_type();
  v.conj = t.is_conj();
  v.neg = t.is_neg();
  v.dense = t.is_contiguous() && !v.conj && !v.neg;
  v.nbytes = t.nbytes();
  return v;
}

void run_copy(const View& dst, const View& src, double delay) {
  sleep_seconds(delay);
  if (dst.dense && src.dense && dst.dtype == src.dtype && dst.nbytes == src.nbytes) {
    std::memcpy(dst.base, src.base, dst.nbytes);
  } else {
    at::Tensor out = dst.tensor();
    out.copy_(src.tensor());
  }
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(self.defined() && dst.defined(), "emu: copy of an undefined tensor");
  const bool src_emu = self.is_privateuseone();
  const bool dst_emu = dst.is_privateuseone();
  TORCH_CHECK((src_emu || self.is_cpu()) && (dst_emu || dst.is_cpu()),
              "emu: copies only between emu and cpu tensors, got ", self.device(), " -> ", dst.device());
  if (dst.numel() == 0) {
    return dst;
  }
  at::assert_no_internal_overlap(dst);
  if (src_emu && dst_emu) {
    at::assert_no_partial_overlap(dst, self);  // what TensorIterator checks for a CPU or CUDA copy
    // Device to device: asynchronous whatever non_blocking says (as on CUDA), on the destination's current
    // stream, which first waits for what the source device's current stream has queued.
    Worker& w = current_worker(dst.device().index());
    if (self.device() != dst.device()) {
      Worker& other = current_worker(self.device().index());
      const uint64_t seq = other.enqueued();
      if (seq > 0) {
        w.enqueue([&other, seq] { other.wait_quietly(seq); });
      }
    }
    w.enqueue([d = describe(dst, true), s = describe(self, false), delay = copy_delay()] { run_copy(d, s, delay); });
    return dst;
  }
  const at::Tensor& host = src_emu ? dst : self;
  Worker& w = current_worker((src_emu ? self : dst).device().index());
  View d = describe(dst, true);
  View s = describe(self, false);
  const double delay = copy_delay();
  if (non_blocking && is_pinned_ptr(host.storage().data())) {
    // Only a non_blocking copy with pinned host memory returns before it has run. The task keeps the pinned
    // storage alive until then (CUDA's host allocator records an event for the same purpose); its deleter is
    // ours and needs no GIL.
    w.enqueue([d = std::move(d), s = std::move(s), delay, keep = host.storage()] { run_copy(d, s, delay); });
    return dst;
  }
  // Any other copy returns once it has run: this stream up to the copy, a stream synchronization and not a
  // device-wide one. The caller keeps the host memory alive meanwhile (a storage released on the worker could
  // need the GIL, numpy's for one, while this thread holds it).
  w.wait(w.enqueue([d = std::move(d), s = std::move(s), delay] { run_copy(d, s, delay); }));
  return dst;
}

// Grows a tensor's storage on the device, if needed, to hold the elements its sizes, strides and offset reach.
void fit_storage(c10::TensorImpl* impl) {
  const size_t bytes = at::detail::computeStorageNbytes(impl->sizes(), impl->strides(), impl->dtype().itemsize(),
                                                        impl->storage_offset());
  const c10::Storage& storage = impl->unsafe_storage();
  if (bytes > storage.nbytes()) {
    resize_storage_bytes(storage.unsafeGetStorageImpl(), bytes);
  }
}

const at::Tensor& resize(const at::Tensor& self, c10::SymIntArrayRef size,
                         std::optional<at::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  at::native::resize_impl_cpu_(impl, C10_AS_INTARRAYREF_SLOW(size), std::nullopt, /*resize_storage=*/false);
  fit_storage(impl);
  if (memory_format.has_value()) {
    TORCH_CHECK(*memory_format != at::MemoryFormat::Preserve, "emu: unsupported memory format ", *memory_format);
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

at::Tensor& set_storage(at::Tensor& result, at::Storage storage, int64_t storage_offset, c10::IntArrayRef size,
                        c10::IntArrayRef stride) {
  at::native::checkSetStorage(result, storage, storage_offset, size, stride);
  c10::TensorImpl* impl = result.unsafeGetTensorImpl();
  impl->set_storage_offset(storage_offset);
  const at::OptionalIntArrayRef strides =
      stride.data() != nullptr ? at::OptionalIntArrayRef(stride) : at::OptionalIntArrayRef();
  at::native::resize_impl_cpu_(impl, size, strides, /*resize_storage=*/false);
  fit_storage(impl);
  return result;
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) {
  const auto numel = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  at::Storage storage(at::Storage::use_byte_size_t(), 0, device_allocator(), /*resizable=*/true);
  return set_storage(self, std::move(storage), 0, {0}, {});
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  const c10::Device where = c10::device_or_default(device);
  TORCH_CHECK(where.is_privateuseone(), "emu: empty() for device ", where);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "emu: only strided tensors are supported");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "emu: only CPU memory can be pinned");
  const c10::DeviceGuard guard(where);
  return at::detail::empty_generic(size, device_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  const c10::Device where = c10::device_or_default(device);
  TORCH_CHECK(where.is_privateuseone(), "emu: empty_strided() for device ", where);
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "emu: only strided tensors are supported");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "emu: only CPU memory can be pinned");
  const c10::DeviceGuard guard(where);
  return at::detail::empty_strided_generic(size, stride, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  at::Tensor host = at::empty(self.sizes(), self.options().device(at::kCPU));
  copy_from(self, host, /*non_blocking=*/false);
  return at::_local_scalar_dense(host);
}

at::Tensor& fill_scalar(at::Tensor& self, const at::Scalar& value) {
  if (self.numel() == 0) {
    return self;
  }
  at::assert_no_internal_overlap(self);
  current_worker(self.device().index()).enqueue([v = describe(self, true), value] { v.tensor().fill_(value); });
  return self;
}

at::Tensor& fill_tensor(at::Tensor& self, const at::Tensor& value) {
  TORCH_CHECK(value.dim() == 0, "fill_ only supports 0-dimension value tensor but got tensor with ", value.dim(),
              " dimensions.");
  return fill_scalar(self, value.item());  // a device value is read back first (CUDA would not wait here)
}

at::Tensor& zero(at::Tensor& self) {
  return fill_scalar(self, 0);
}

void record_stream(at::Tensor& self, c10::Stream stream) {
  device_allocator()->recordStream(self.storage().data_ptr(), stream);
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("unfold", at::native::unfold);
  m.impl("view_as_real", at::native::view_as_real);
  m.impl("view_as_complex", at::native::view_as_complex);
  m.impl("resize_", resize);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("fill_.Scalar", fill_scalar);
  m.impl("fill_.Tensor", fill_tensor);
  m.impl("zero_", zero);
  m.impl("record_stream", record_stream);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// The operators behind weightsync.emuaccel's Python API and the torch.emu module. Plain operators (not a Python
// extension module): the library needs no Python headers, and torch.ops.load_library loads it in any process.
TORCH_LIBRARY(weightsync_emu, m) {
  m.def("device_count() -> int", [] { return static_cast<int64_t>(device_count()); });
  m.def("current_device() -> int", [] { return static_cast<int64_t>(current_device()); });
  m.def("set_device(int device) -> ()", [](int64_t device) {
    set_current_device(static_cast<c10::DeviceIndex>(device));
  });
  m.def("synchronize(int device) -> ()", [](int64_t device) {
    synchronize_device(static_cast<c10::DeviceIndex>(device));
  });
  m.def("synchronizations() -> int", [] { return synchronizations(); });
  m.def("set_copy_delay(float seconds) -> ()", [](double seconds) { set_copy_delay(seconds); });
  m.def("copy_delay() -> float", [] { return copy_delay(); });
  m.def("in_bad_fork() -> bool", [] { return in_bad_fork(); });
  m.def("memory_allocated(int device) -> int", [](int64_t device) {
    const auto stats = device_allocator()->getDeviceStats(static_cast<c10::DeviceIndex>(device));
    return stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].current;
  });
  m.def("empty_cache() -> ()", [] { device_allocator()->emptyCache(); });
}

}  // namespace weightsync_emu
