// The native launch of datapath's plain row gather: check the indices, allocate the output and
// queue the kernel in one call from Python (`datapath._runtime.native`).
//
// Built on first use by torch.utils.cpp_extension against the running PyTorch; it needs no CUDA
// headers: the kernel (a CUfunction compiled by NVRTC) and the driver's cuLaunchKernel arrive as
// addresses, and the output comes from ATen's allocator (the caching allocator on a CUDA device).
//
// A call returns None wherever it does not apply (other indices, an error recorded by an earlier
// launch, a misaligned output, a thread without a CUDA context): the caller then takes the Python
// path, which decides, reports or raises exactly as before.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <cstdint>
#include <new>
#include <vector>

namespace {

// CUresult cuLaunchKernel(CUfunction, grid xyz, block xyz, shared bytes, CUstream, void** params, void** extra)
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                         void**, void**);

constexpr int64_t kNoError = INT64_MIN;  // datapath.memory.bounds.NO_ERROR
constexpr int kInvalidContext = 201;     // CUDA_ERROR_INVALID_CONTEXT
constexpr const char* kCapsule = "datapath.native.PlainGather";

// Everything a plain gather of one host table needs but the indices: fixed when the plan is made.
struct PlainGather {
    LaunchFn launch;
    void* function;
    void* stream;
    uint64_t table;
    int64_t n_rows, row_stride, row_bytes, threads, rows_per_block, max_blocks;
    int32_t lanes;
    uint64_t align_mask;  // the output's address must clear these bits (the kernel's word width - 1)
    int device;
    c10::ScalarType index_type;
    at::TensorOptions out_options;
    std::vector<int64_t> rest;  // the output's row shape
};

PyObject* launch_error = nullptr;  // datapath._runtime.kernels.LaunchError, set by set_launch_error
std::atomic<unsigned long long> launches{0};  // kernels queued by gather (what `launches()` reports)

void free_plan(PyObject* capsule) {
    delete static_cast<PlainGather*>(PyCapsule_GetPointer(capsule, kCapsule));
}

bool as_u64(PyObject* o, uint64_t& out) {
    out = PyLong_AsUnsignedLongLongMask(o);
    return !PyErr_Occurred();
}

bool as_i64(PyObject* o, int64_t& out) {
    out = PyLong_AsLongLong(o);
    return !PyErr_Occurred();
}

// plain_gather(launch, function, stream, table, n_rows, row_stride, row_bytes, threads, rows_per_block,
//              max_blocks, lanes, align, index_template, out_template, rest) -> capsule
PyObject* plain_gather(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "plain_gather takes 15 arguments");
        return nullptr;
    }
    if (!THPVariable_Check(args[12]) || !THPVariable_Check(args[13]) || !PyTuple_Check(args[14])) {
        PyErr_SetString(PyExc_TypeError, "plain_gather: index and output templates must be tensors, rest a tuple");
        return nullptr;
    }
    auto plan = new (std::nothrow) PlainGather();
    if (plan == nullptr) return PyErr_NoMemory();
    uint64_t launch, function, stream, align;
    int64_t lanes;
    bool ok = as_u64(args[0], launch) && as_u64(args[1], function) && as_u64(args[2], stream) &&
              as_u64(args[3], plan->table) && as_i64(args[4], plan->n_rows) && as_i64(args[5], plan->row_stride) &&
              as_i64(args[6], plan->row_bytes) && as_i64(args[7], plan->threads) &&
              as_i64(args[8], plan->rows_per_block) && as_i64(args[9], plan->max_blocks) &&
              as_i64(args[10], lanes) && as_u64(args[11], align);
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(args[14]); ++i) {
        int64_t d;
        ok = as_i64(PyTuple_GET_ITEM(args[14], i), d);
        plan->rest.push_back(d);
    }
    if (!ok || launch == 0 || function == 0 || plan->rows_per_block <= 0 || plan->max_blocks <= 0 ||
        plan->threads <= 0 || align == 0 || (align & (align - 1)) != 0) {
        delete plan;
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "plain_gather: bad launch settings");
        return nullptr;
    }
    plan->launch = reinterpret_cast<LaunchFn>(launch);
    plan->function = reinterpret_cast<void*>(function);
    plan->stream = reinterpret_cast<void*>(stream);
    plan->lanes = static_cast<int32_t>(lanes);
    plan->align_mask = align - 1;
    const at::Tensor& index_template = THPVariable_Unpack(args[12]);
    const at::Tensor& out_template = THPVariable_Unpack(args[13]);
    plan->index_type = index_template.scalar_type();
    plan->device = out_template.device().index();
    plan->out_options = out_template.options();
    return PyCapsule_New(plan, kCapsule, free_plan);
}

// gather(plan, idx, flag_address, limit) -> (m, *rest) CUDA tensor of rows idx in the caller's order, or None
// (the caller takes the Python path): 0 < m < limit rows, 1-D contiguous indices of the plan's dtype and device
PyObject* gather(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyCapsule_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "gather(plan, idx, flag_address, limit)");
        return nullptr;
    }
    auto* plan = static_cast<PlainGather*>(PyCapsule_GetPointer(args[0], kCapsule));
    if (plan == nullptr) return nullptr;
    if (!THPVariable_CheckExact(args[1])) Py_RETURN_NONE;
    const at::Tensor& idx = THPVariable_Unpack(args[1]);
    const uint64_t flag = PyLong_AsUnsignedLongLongMask(args[2]);
    const int64_t limit = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return nullptr;
    if (flag == 0 || *reinterpret_cast<const volatile int64_t*>(flag) != kNoError) Py_RETURN_NONE;
    if (idx.scalar_type() != plan->index_type || idx.dim() != 1 || !idx.is_cuda() ||
        idx.device().index() != plan->device || idx.stride(0) != 1) {
        Py_RETURN_NONE;
    }
    int64_t m = idx.size(0);
    if (m <= 0 || m >= limit) Py_RETURN_NONE;
    std::vector<int64_t> shape;
    shape.reserve(plan->rest.size() + 1);
    shape.push_back(m);
    shape.insert(shape.end(), plan->rest.begin(), plan->rest.end());
    at::Tensor out;
    try {
        out = at::empty(shape, plan->out_options);
    } catch (const std::exception&) {
        Py_RETURN_NONE;  // out of memory and the like: the Python path raises PyTorch's own error
    }
    uint64_t out_ptr = reinterpret_cast<uint64_t>(out.data_ptr());
    if (out_ptr & plan->align_mask) Py_RETURN_NONE;
    int64_t blocks = (m + plan->rows_per_block - 1) / plan->rows_per_block;
    if (blocks > plan->max_blocks) blocks = plan->max_blocks;
    uint64_t table = plan->table, idx_ptr = reinterpret_cast<uint64_t>(idx.data_ptr()), order = 0;
    int64_t n_rows = plan->n_rows, row_stride = plan->row_stride, row_bytes = plan->row_bytes;
    int32_t lanes = plan->lanes;
    uint64_t err = flag;
    void* params[] = {&table, &n_rows, &row_stride, &row_bytes, &idx_ptr, &order, &m, &out_ptr, &lanes, &err};
    int rc = plan->launch(plan->function, static_cast<unsigned>(blocks), 1, 1, static_cast<unsigned>(plan->threads),
                          1, 1, 0, plan->stream, params, nullptr);
    if (rc == kInvalidContext) Py_RETURN_NONE;  // the Python launch binds the context and retries
    if (rc != 0) {
        if (launch_error != nullptr) {
            PyObject* e = PyObject_CallFunction(launch_error, "i", rc);
            if (e != nullptr) {
                PyErr_SetObject(launch_error, e);
                Py_DECREF(e);
            }
        } else {
            PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed with CUDA error %d", rc);
        }
        return nullptr;
    }
    launches.fetch_add(1, std::memory_order_relaxed);
    return THPVariable_Wrap(std::move(out));
}

PyObject* launch_count(PyObject*, PyObject*) { return PyLong_FromUnsignedLongLong(launches.load()); }

PyObject* set_launch_error(PyObject*, PyObject* cls) {
    Py_XINCREF(cls);
    Py_XSETREF(launch_error, cls);
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"plain_gather", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(plain_gather)), METH_FASTCALL,
     "The plan of a plain gather from one host table (a capsule)."},
    {"gather", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(gather)), METH_FASTCALL,
     "gather(plan, idx, flag_address, limit): the rows, or None where the Python path must run."},
    {"set_launch_error", set_launch_error, METH_O, "The exception class a refused launch raises."},
    {"launches", launch_count, METH_NOARGS, "How many kernels gather has queued in this process."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "datapath_native", "datapath's native launches", -1, methods};

}  // namespace

#define DP_CAT2(a, b) a##b
#define DP_CAT(a, b) DP_CAT2(a, b)
PyMODINIT_FUNC DP_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
