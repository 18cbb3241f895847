// The Python module binding every CPU op of kernels/csrc.
#include <torch/extension.h>

torch::Tensor decode_attention(torch::Tensor query, torch::Tensor key_cache,
                               torch::Tensor value_cache, torch::Tensor block_tables,
                               torch::Tensor context_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over the KV cache");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("rotary", &rotary, "rotary embedding of each head (rotate-half layout)");
}
