// The flash_msa._C Python module. flash_msa::Error derives from std::invalid_argument, which
// pybind11 turns into ValueError with the message intact; std::runtime_error becomes
// RuntimeError.
#include <torch/extension.h>

#include "ops.h"

#ifdef FLASH_MSA_WITH_CUDA
#include "flash_msa/cuda.h"
#endif

namespace {

bool cuda_device_available() {
#ifdef FLASH_MSA_WITH_CUDA
  return flash_msa::cuda::device_available();
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace ext = flash_msa::torch_ext;
  namespace py = pybind11;
  m.doc() = "flash-msa: MiniMax Sparse Attention training kernels (torch bindings)";
  // The ops run without the GIL: CPU work runs in parallel with other Python threads.
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("select", &ext::select, no_gil, py::arg("qp"), py::arg("kp"), py::arg("top_k_blocks"),
        py::arg("proxy_scale"), py::arg("cu_seqlens"), py::arg("query_offset"), py::arg("fp8"));
  m.def("check_indices", &ext::check_indices, no_gil, py::arg("indices"), py::arg("cu_seqlens"),
        py::arg("seqlen"), py::arg("query_offset"));
  m.def("forward", &ext::forward, no_gil, py::arg("qp"), py::arg("kp"), py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("indices"), py::arg("scale"), py::arg("proxy_scale"),
        py::arg("cu_seqlens"), py::arg("compute_kl"), py::arg("query_offset"));
  m.def("backward", &ext::backward, no_gil, py::arg("dout"), py::arg("kl_grad"), py::arg("qp"),
        py::arg("kp"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"), py::arg("lse"),
        py::arg("lse_proxy"), py::arg("indices"), py::arg("scale"), py::arg("proxy_scale"),
        py::arg("cu_seqlens"), py::arg("kl_out"), py::arg("query_offset"));
  m.def("explain", &ext::explain, py::arg("qp"), py::arg("kp"), py::arg("q"), py::arg("k"),
        py::arg("top_k_blocks"), py::arg("warmup"), py::arg("kl_value_in_forward"),
        py::arg("fp8"), py::arg("query_offset"));
  m.def("built_with_cuda", &ext::built_with_cuda);
  m.def("cuda_device_available", &cuda_device_available,
        "True when built with CUDA and a device of compute capability >= 8.0 is visible");
}
