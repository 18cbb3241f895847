// The Python module binding every CPU op of kernels/csrc.
#include <torch/extension.h>

torch::Tensor decode_attention(torch::Tensor query, torch::Tensor key_cache,
                               torch::Tensor value_cache, torch::Tensor block_tables,
                               torch::Tensor context_lens, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                                      torch::Tensor weight, double eps);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
              torch::Tensor value_cache, torch::Tensor slot_mapping);
torch::Tensor silu_and_mul(torch::Tensor x);
bool amx_available();
torch::Tensor amx_pack_weight(torch::Tensor weight);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                         c10::optional<torch::Tensor> bias);
bool bf16_linear_available();
int64_t bf16_linear_max_rows();
torch::Tensor bf16_pack_weight(torch::Tensor weight);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t block);
torch::Tensor argmax_rows(torch::Tensor logits);

// at::parallel_for initialises each thread lazily, on its first call, from the count any thread
// set last; this module is built apart from libtorch, so it keeps its own per-thread flag.
void init_threads() { at::internal::lazy_init_num_threads(); }

// The long-running ops release the GIL while they run, as torch's own ops do: a worker's KV
// receiver, token pusher and RPC threads then run beside a decode step instead of waiting for
// it. The short element-wise ops keep it (taking it back would cost about what they run).
using no_gil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("init_threads", &init_threads, "this module's per-thread set-up of at::parallel_for");
  m.def("decode_attention", &decode_attention, "paged decode attention over the KV cache",
        no_gil());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, "(RMSNorm of x + residual, x + residual), one pass");
  m.def("rotary", &rotary, "rotary embedding of each head (rotate-half layout)");
  m.def("store_kv", &store_kv, "write new K/V rows into the paged cache at their slots");
  m.def("silu_and_mul", &silu_and_mul, "SiLU of the first half times the second half");
  m.def("amx_available", &amx_available, "whether this CPU (and build) has the AMX bf16 unit");
  m.def("amx_pack_weight", &amx_pack_weight, "a bf16 [N, K] weight in amx_linear's layout");
  m.def("amx_linear", &amx_linear, "x [<=16, K] bf16 times a packed weight, on AMX tiles",
        no_gil());
  m.def("bf16_linear_available", &bf16_linear_available,
        "whether this CPU (and build) has AVX-512 (with BF16 or without) for bf16_linear");
  m.def("bf16_linear_max_rows", &bf16_linear_max_rows,
        "the most rows bf16_linear takes (16 with AVX-512 BF16; any, emulated)");
  m.def("bf16_pack_weight", &bf16_pack_weight, "a bf16 [N, K] weight in bf16_linear's layout");
  m.def("bf16_linear", &bf16_linear, "x [M, K] bf16 times a packed weight, on AVX-512",
        no_gil());
  m.def("argmax_rows", &argmax_rows, "the first index of each row's maximum (NaN ranks top)");
}
