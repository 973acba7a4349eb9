// The Python module of the CPU kernels, built by engine/cpu_kernels.py.
#include "simd.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

std::vector<std::string> available_paths() {
  std::vector<std::string> names;
  for (auto [path, name] : {std::pair{inherent::Path::kAvx512, "avx512"},
                            std::pair{inherent::Path::kAvx2, "avx2"},
                            std::pair{inherent::Path::kPortable, "portable"}})
    if (inherent::path_available(path)) names.emplace_back(name);
  return names;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute kernels run without the GIL, as torch's own operators do: the API's threads
  // (retrieval, receipts, the event loop) then run during a step's kernels instead of waiting
  // for the engine thread to return to Python.
  const auto without_gil = py::call_guard<py::gil_scoped_release>();
  m.def("available_paths", &available_paths, "implementations this build and CPU run, widest first");
  m.def("paged_attention", &paged_attention, without_gil,
        "fixed-order paged attention (CPU; float32 or bfloat16 cache)", py::arg("q"),
        py::arg("cache"), py::arg("block_tables"), py::arg("token_seq"), py::arg("positions"),
        py::arg("scale"), py::arg("path"));
  m.def("set_decode_blocks_in_turn", &set_decode_blocks_in_turn,
        "a lone decode reads two cache blocks in turn (or one at a time); returns the old setting",
        py::arg("on"));
  m.def("add_rms_norm", &add_rms_norm, without_gil, "x += delta; RMSNorm(x), in place on x", py::arg("x"),
        py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("bf16_out"), py::arg("path"));
  m.def("rope_write", &rope_write, without_gil, "RoPE on q and k; k and v into the paged cache; q returned",
        py::arg("qkv"), py::arg("cos_sin"), py::arg("positions"), py::arg("slots"),
        py::arg("cache"), py::arg("num_heads"), py::arg("path"));
  m.def("silu_mul", &silu_mul, without_gil, "silu(gate) * up of a fused gate_up projection", py::arg("gate_up"),
        py::arg("path"));
  m.attr("packed_bf16") = kPackedBf16;
  m.attr("block_bf16") = kBlockBf16;
  m.def("quant_block_bytes", &quant_block_bytes, "bytes of a GGUF block type's block, 0 if unsupported",
        py::arg("qtype"));
  m.def("quant_linear", &quant_linear, without_gil, "x @ W.T, W as GGUF blocks (Q4_1, Q8_0); float32 arithmetic",
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("path"));
  py::class_<BlockStack>(m, "BlockStack", "a decoder's layers on our kernels, one call a step")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>,
                    std::vector<int64_t>, at::Tensor, int64_t, double, double, bool>(),
           py::arg("norms"), py::arg("matrices"), py::arg("qtypes"), py::arg("columns"),
           py::arg("cos_sin"), py::arg("num_heads"), py::arg("eps"), py::arg("scale"),
           py::arg("bf16_norm_out"))
      .def("forward", &BlockStack::forward, without_gil, py::arg("x"), py::arg("caches"),
           py::arg("positions"), py::arg("slots"), py::arg("block_tables"), py::arg("token_seq"),
           py::arg("path"));
  m.attr("bf16_linear_supported") = bf16_linear_supported();
  m.def("bf16_linear_paths", &bf16_linear_paths, "bf16_linear's paths this build and CPU run, fastest first");
  m.def("pack_bf16_weight", &pack_bf16_weight, without_gil, "pack [N, K] for bf16_linear", py::arg("weight"));
  m.def("bf16_linear", &bf16_linear, without_gil, "x @ W.T: bf16 inputs, float32 accumulation and result",
        py::arg("x"), py::arg("packed"), py::arg("columns"), py::arg("path"));
  m.def("pack_block_bf16", &pack_block_bf16, without_gil,
        "GGUF blocks as block_bf16_linear reads them", py::arg("blocks"), py::arg("qtype"));
  m.def("block_bf16_linear", &block_bf16_linear, without_gil,
        "bf16_linear's AVX512-BF16 bits with the weight read as GGUF blocks", py::arg("x"),
        py::arg("packed"), py::arg("qtype"), py::arg("columns"));
}
