// The native forward: the target's forward as one native call per verify and its LM head as
// another (target.h), the drafter's feature append and block draft (drafter.h), both on the
// shared arithmetic of kernels.h.
//
// Built twice by build.py from this one translation unit: with -mavx512{f,bw,vl,vnni} (module
// adaspark_native_avx512) and with -mavx2 -mfma (adaspark_native_avx2); native.py imports the
// one the CPU runs. Threads come from torch's own pool (at::parallel_for), never a second
// OpenMP runtime.
//
// Why it is shaped this way:
// - Weights stay quantised (Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K repacked by
//   native/__init__.py into unsigned integers u with value = d*u + m per block of 32, Q6_K per
//   16; F16 / BF16 / F32 kept as floats, fdot.h); activations are quantised per block of 32
//   to int8 (scale dx, integer sum sx), so a block's dot is d*dx*sum(u*x) + m*dx*sx, an exact integer
//   dot product (VNNI's vpdpbusd, or AVX2's maddubs) and two float terms. This is ggml's Q8
//   activation arithmetic.
// - A weight tile is loaded and unpacked once per call and used for every row of the call, so
//   extra verify rows add arithmetic, not weight traffic.
// - K/V are cached in fp16: attention reads half the bytes at long contexts.
// - Every row is computed by the same instruction sequence whatever the other rows are and
//   however many share the call (per-row accumulators, fixed reduction order, attention summed
//   slot by slot in slot order). A row's logits and hidden states are bit-identical in a tree,
//   a chain, a one-row decode step or a prefill chunk: speculation emits exactly plain decoding's
//   tokens in fast precision too.
#include <optional>

#include "drafter.h"
#include "target.h"

using namespace adaspark;

// module_local: the avx512 and avx2 builds define the same C++ types and may share a process.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ISA") = kIsa;
  m.attr("FC_HALF") = true;  // Drafter takes fc as float16 (builds before it: float32 only)
  m.attr("MARKOV_HALF") = true;  // ... and W2 (builds before it: float32 only)
  // use_amx(): whether calls use AMX tiles; use_amx(False/True) turns them off / back on where
  // usable. The avx2 build has no tiles.
  m.def("use_amx", [](std::optional<bool> on) {
#ifdef ADASPARK_AVX512
    if (on) amx_on() = *on && amx_usable();
    return amx_on();
#else
    return false;
#endif
  }, py::arg("on") = py::none());
  py::class_<QPart>(m, "QPart", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, torch::Tensor, torch::Tensor, torch::Tensor,
                    int64_t, int64_t, torch::Tensor, torch::Tensor>(),
           py::arg("bits"), py::arg("n"), py::arg("k"), py::arg("q"), py::arg("d"), py::arg("m"),
           py::arg("zero") = 0, py::arg("halves") = 1,
           py::arg("d_super") = torch::empty({0}, torch::kHalf),
           py::arg("m_super") = torch::empty({0}, torch::kHalf))
      .def(py::init<int64_t, int64_t, torch::Tensor>(), py::arg("n"), py::arg("k"),
           py::arg("dense"))
      .def_readonly("bits", &QPart::bits)
      .def_readonly("zero", &QPart::zero)
      .def_readonly("halves", &QPart::halves)
      .def_readonly("f32", &QPart::f32)
      .def_readonly("factors", &QPart::factors);
  py::class_<QWeight>(m, "QWeight", py::module_local())
      .def(py::init<std::vector<QPart>>(), py::arg("parts"))
      .def(py::init([](int64_t bits, int64_t n, int64_t k, torch::Tensor q, torch::Tensor d,
                       torch::Tensor mins, int64_t zero) {
             const auto none = torch::empty({0}, torch::kHalf);
             return QWeight({QPart(bits, n, k, q, d, mins, zero, 1, none, none)});
           }),
           py::arg("bits"), py::arg("n"), py::arg("k"), py::arg("q"), py::arg("d"), py::arg("m"),
           py::arg("zero") = 0)
      .def("matmul", [](const QWeight& w, torch::Tensor x) { return qmatmul(w, x); },
           py::call_guard<py::gil_scoped_release>())
      // rows(ids): float32 [ids, k], each row as gguf dequantises it (embedding lookups)
      .def("rows", &weight_rows, py::arg("ids"), py::call_guard<py::gil_scoped_release>())
      .def_readonly("n", &QWeight::n)
      .def_readonly("k", &QWeight::k)
      .def_readonly("parts", &QWeight::parts)
      .def_property_readonly("zero", [](const QWeight& w) { return w.parts[0].zero; });
  py::class_<Model>(m, "Model", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, torch::Tensor,
                    torch::Tensor, QWeight, torch::Tensor, QWeight, torch::Tensor,
                    torch::Tensor, double, double>())
      .def("add_layer", &Model::add_layer, py::arg("attn_norm"), py::arg("ffn_norm"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("qkv_bias"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("post_attn_norm") = torch::empty({0}), py::arg("post_ffn_norm") =
           torch::empty({0}), py::arg("act") = "silu", py::arg("window") = 0,
           py::arg("rope_cos") = torch::empty({0}), py::arg("rope_sin") = torch::empty({0}),
           py::arg("conv_taps") = torch::empty({0}))
      .def("route_layer", &Model::route_layer, py::arg("layer"), py::arg("router"),
           py::arg("bias"), py::arg("gate_exps"), py::arg("up_exps"), py::arg("down_exps"),
           py::arg("used"), py::arg("gating"), py::arg("norm"))
      .def("ffn", &Model::ffn, py::arg("layer"), py::arg("h"),
           py::call_guard<py::gil_scoped_release>())
      .def("forward", &Model::forward, py::arg("cache_k"), py::arg("cache_v"), py::arg("tokens"),
           py::arg("positions"), py::arg("start"), py::arg("anc"), py::arg("taps"),
           py::arg("conv") = torch::empty({0}, torch::kHalf),
           py::arg("conv_src") = torch::empty({0}, torch::kLong),
           py::call_guard<py::gil_scoped_release>())
      .def("forward_batch", &Model::forward_batch, py::arg("caches_k"), py::arg("caches_v"),
           py::arg("starts"), py::arg("counts"), py::arg("tokens"), py::arg("positions"),
           py::arg("anc"), py::arg("taps"),
           py::arg("caches_conv") = std::vector<torch::Tensor>{},
           py::arg("conv_src") = torch::empty({0}, torch::kLong),
           py::call_guard<py::gil_scoped_release>())
      .def("head", &Model::head, py::call_guard<py::gil_scoped_release>());
  py::class_<Drafter>(m, "Drafter", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, torch::Tensor,
                    torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, QWeight,
                    torch::Tensor, torch::Tensor, torch::Tensor, double, torch::Tensor>())
      .def("add_layer", &Drafter::add_layer, py::arg("attn_norm"), py::arg("ffn_norm"),
           py::arg("qkv"), py::arg("kv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("q_norm") = torch::empty({0}), py::arg("k_norm") = torch::empty({0}),
           py::arg("qk_eps") = -1.0)
      .def("set_markov_keys", &Drafter::set_markov_keys)
      .def("set_markov_bound", &Drafter::set_markov_bound)
      .def("set_markov_table", &Drafter::set_markov_table)
      .def("append", &Drafter::append, py::call_guard<py::gil_scoped_release>())
      .def("backbone", &Drafter::backbone, py::call_guard<py::gil_scoped_release>())
      .def("markov", &Drafter::markov, py::call_guard<py::gil_scoped_release>())
      .def("draft", &Drafter::draft, py::call_guard<py::gil_scoped_release>())
      .def("set_vocab", &Drafter::set_vocab)
      .def("draft_token", &Drafter::draft_token, py::call_guard<py::gil_scoped_release>())
      .def("phase_ms", &Drafter::phase_ms);
}
