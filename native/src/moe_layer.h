// One MoE layer's CPU-resident experts, computed in one call:
//
//   out[t] = sum over slots j of token t whose expert e = ids[t, j] is CPU-resident of
//            weights[t, j] * (down_e(act(gate_e(x[t]) + bg_e, up_e(x[t]) + bu_e)) + bd_e)
//
// Experts not resident on the CPU (on the main device), and ids outside [0, E) (-1 pads),
// contribute nothing; out is the float32 partial sum, zero where nothing was computed.
//
// Per call, each expert hit is computed in one of two regimes, chosen by how many tokens
// it got (see kPrefillMinTokens in moe_layer.cpp for the measured switch point):
//   decode   few tokens: streaming GEMV over the stored blocks with the activations
//            quantized to Q8 once per call; memory-bound, so each weight byte is read once
//            and used for up to four tokens while it is in registers;
//   prefill  many tokens: the tokens grouped by expert, weight tiles dequantized to fp32
//            once per call into cache-sized panels and reused by every token of the
//            expert in a register-blocked GEMM; compute-bound.
#pragma once

#include <cstdint>
#include <vector>

#include "formats.h"
#include "kernel_table.h"
#include "repack.h"

namespace hmoe {

class Executor;

enum class Activation : int { SwiGLU = 0, GptOss = 1 };

// How a call picks the regime of each expert: by its token count (Auto), forced (the
// benchmark measures both sides of the switch point this way), or (Prompt) by the stored
// format alone, whatever the count (prompt_takes_gemv), so that a prompt computes the same
// numbers however it was split into chunks.
enum class Regime : int { Auto = 0, Decode = 1, Prefill = 2, Prompt = 3 };

struct ExpertWeights {
    MatrixRef gate, up, down;  // [I, H], [I, H], [H, I]
    const float* gate_bias = nullptr;  // [I] fp32, optional (GPT-OSS)
    const float* up_bias = nullptr;    // [I]
    const float* down_bias = nullptr;  // [H]
};

class MoELayer {
public:
    // experts[e] is read only where cpu[e] is true. gate and up are stored as `fmt`, down as
    // `down_fmt` (GGUF quant mixes such as Q4_K_M keep ffn_down in a wider type).
    MoELayer(Format fmt, Format down_fmt, int64_t hidden, int64_t inter, std::vector<ExpertWeights> experts, std::vector<uint8_t> cpu,
             Activation act, float alpha, float limit);
    MoELayer(MoELayer&&) = default;
    MoELayer(const MoELayer&) = delete;  // it may own its experts' copies

    // x [T, H] (fp32, or bf16 when x_bf16), ids [T, k] int64, weights [T, k] fp32, out [T, H]
    // fp32 (overwritten). Runs on `exec`'s threads and the calling thread.
    void forward(Executor& exec, const KernelTable& kt, const void* x, bool x_bf16, int64_t T, const int64_t* ids,
                 const float* weights, int k, float* out, Regime regime, int prefill_min_tokens) const;

    // Replace the CPU experts' q4_0 / iq4_nl / iq4_xs / int4_g32 / q4_k / q8_0 matrices by row-interleaved copies (repack.h)
    // that the layer owns, made on the pool's threads (each expert's by a thread of the node
    // that computes it, so first touch places it there). Source pages that belong to a
    // read-only file mapping are released afterwards (they stay in the page cache, from
    // which the kernel can drop them), so the host does not hold the experts twice.
    void interleave(Executor& exec);
    int64_t copied_bytes() const { return owned_bytes_; }

    // Ask the kernel to keep each expert's bytes on the NUMA node whose threads compute it
    // (only meaningful with more than one node). Returns how many ranges were bound.
    int bind_to_nodes(const Executor& exec);

    Format format() const { return fmt_; }
    Format down_format() const { return down_fmt_; }
    int64_t hidden() const { return H_; }
    int64_t inter() const { return I_; }
    int64_t n_experts() const { return int64_t(experts_.size()); }
    int64_t n_cpu_experts() const;
    bool is_cpu(int64_t e) const { return e >= 0 && e < n_experts() && cpu_[size_t(e)]; }
    int node_of(int64_t e, int n_nodes) const;
    // Stored bytes of one CPU expert's three matrices (what a decode step reads per expert hit).
    int64_t expert_bytes() const;

private:
    Format fmt_, down_fmt_;
    int64_t H_, I_;
    std::vector<ExpertWeights> experts_;
    std::vector<uint8_t> cpu_;
    std::vector<int> rank_;  // rank of each CPU expert among the CPU experts (node assignment)
    Activation act_;
    float alpha_, limit_;
    std::vector<OwnedBytes> owned_;  // the copies, one block per NUMA node
    int64_t owned_bytes_ = 0;
};

// The tokens-per-expert count from which experts stored as `fmt` take the prefill regime
// (measured; see .cpp).
int default_prefill_min_tokens(const KernelTable& kt, Format fmt);

}  // namespace hmoe
