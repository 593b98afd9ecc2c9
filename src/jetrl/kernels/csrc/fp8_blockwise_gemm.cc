// Blockwise-scaled FP8 GEMM on Hopper through cuBLASLt, as an XLA FFI custom call.
//
//   out[p, q] = sum_kb a_scale[p, kb] * b_scale[q or q / 128, kb] * (a[p, kb] . b[q, kb])
//
// a [P, C] and b [Q, C] are FP8 (E4M3 or E5M2), row-major, contiguous along the contraction
// axis C (the "TN" layout FP8 tensor cores take). a's scales are per 1x128 group along C;
// b's are either per 1x128 group too (wgrad) or per 128x128 block (a weight: fprop, dgrad).
// cuBLASLt (>= 12.9, compute capability 9.0) runs these with its VEC128_32F and
// BLK128x128_32F scale modes, promoting each 128-element block's partial sum to float32.
//
// Row-major out [P, Q] is column-major out^T [Q, P], so cuBLAS computes
//   D (Q x P) = op(A) (Q x C) * op(B) (C x P),  A = b (C x Q col-major, transposed),
//                                               B = a (C x P col-major, not transposed).
// Scale layouts cuBLASLt reads (docs/numerics.md, "The GPU GEMMs and their tolerance"):
//   VEC128 of an operand with outer size R: float [ceil(C/128), R], R contiguous;
//   BLK128x128 of A (outer size Q):         float [ceil(Q/128), ld], ld >= ceil(C/128).
//
// No CUDA or cuBLAS header is needed to build this file: the few cuBLASLt entry points and
// enum values it uses are declared below (checked against cublasLt.h 13.x), and the symbols
// resolve at load time against the libcublasLt that the process already has loaded (XLA's).

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" {
typedef int cublasStatus_t;
typedef struct cublasLtContext* cublasLtHandle_t;
typedef struct { uint64_t data[32]; } cublasLtMatmulDescOpaque_t;
typedef cublasLtMatmulDescOpaque_t* cublasLtMatmulDesc_t;
typedef struct { uint64_t data[14]; } cublasLtMatrixLayoutOpaque_t;
typedef cublasLtMatrixLayoutOpaque_t* cublasLtMatrixLayout_t;
typedef struct { uint64_t data[12]; } cublasLtMatmulPreferenceOpaque_t;
typedef cublasLtMatmulPreferenceOpaque_t* cublasLtMatmulPreference_t;
typedef struct { uint64_t data[8]; } cublasLtMatmulAlgo_t;
typedef struct {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
} cublasLtMatmulHeuristicResult_t;
typedef struct CUstream_st* cudaStream_t;

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle);
size_t cublasLtGetVersion(void);
const char* cublasLtGetStatusString(cublasStatus_t status);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, int compute_type,
                                        int scale_type);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, int attr,
                                              const void* buf, size_t size);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, int type,
                                          uint64_t rows, uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref, int attr,
                                                    const void* buf, size_t size);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
    cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
    cublasLtMatmulPreference_t pref, int requested, cublasLtMatmulHeuristicResult_t* results,
    int* returned);
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                              const void* alpha, const void* a, cublasLtMatrixLayout_t adesc,
                              const void* b, cublasLtMatrixLayout_t bdesc, const void* beta,
                              const void* c, cublasLtMatrixLayout_t cdesc, void* d,
                              cublasLtMatrixLayout_t ddesc, const cublasLtMatmulAlgo_t* algo,
                              void* workspace, size_t workspace_size, cudaStream_t stream);
}  // extern "C"

namespace {

// Values from cublas_api.h, library_types.h and cublasLt.h.
constexpr int kComputeF32 = 68;             // CUBLAS_COMPUTE_32F
constexpr int kR32F = 0;                    // CUDA_R_32F
constexpr int kR16BF = 14;                  // CUDA_R_16BF
constexpr int kR8E4M3 = 28;                 // CUDA_R_8F_E4M3
constexpr int kR8E5M2 = 29;                 // CUDA_R_8F_E5M2
constexpr int kOpN = 0, kOpT = 1;           // CUBLAS_OP_N / _T
constexpr int kDescTransA = 3, kDescTransB = 4;
constexpr int kDescAScalePtr = 17, kDescBScalePtr = 18;
constexpr int kDescAScaleMode = 31, kDescBScaleMode = 32;
constexpr int kScaleVec128 = 4;             // CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
constexpr int kScaleBlk128 = 5;             // CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
constexpr int kPrefMaxWorkspace = 1;        // CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES

// dtype codes shared with jetrl/precision/cublaslt.py.
int CudaType(int code) {
  switch (code) {
    case 0: return kR8E4M3;
    case 1: return kR8E5M2;
    case 2: return kR16BF;
    case 3: return kR32F;
  }
  return -1;
}

int CodeOf(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: return 0;
    case ffi::DataType::F8E5M2: return 1;
    case ffi::DataType::BF16: return 2;
    case ffi::DataType::F32: return 3;
    default: return -1;
  }
}

using Key = std::tuple<int64_t, int64_t, int64_t, int, int, int, int, int64_t, uint64_t>;

struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo;
  std::mutex mu;  // the scale pointers are attributes of the shared descriptor
};

std::mutex g_mu;
cublasLtHandle_t g_handle = nullptr;
std::map<Key, Plan*>* g_plans = nullptr;

std::string Status(const char* what, cublasStatus_t s) {
  return std::string(what) + " failed: " + cublasLtGetStatusString(s) + " (" +
         std::to_string(s) + ")";
}

#define JETRL_CHECK(call)                               \
  do {                                                  \
    cublasStatus_t s_ = (call);                         \
    if (s_ != 0) { *err = Status(#call, s_); return nullptr; } \
  } while (0)

// The cached descriptors and algorithm for one problem; nullptr (and *err) if cuBLASLt has
// no algorithm for it. p, q, c: out[P, Q] = a[P, C] . b[Q, C]^T.
Plan* GetPlan(int64_t p, int64_t q, int64_t c, int ta, int tb, int tout, int b_blocks,
              int64_t b_ld, uint64_t workspace, std::string* err) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_handle == nullptr) {
    cublasStatus_t s = cublasLtCreate(&g_handle);
    if (s != 0) { *err = Status("cublasLtCreate", s); g_handle = nullptr; return nullptr; }
    g_plans = new std::map<Key, Plan*>();
  }
  Key key{p, q, c, ta, tb, tout, b_blocks, b_ld, workspace};
  auto it = g_plans->find(key);
  if (it != g_plans->end()) return it->second;
  if (CudaType(ta) < 0 || CudaType(tb) < 0 || CudaType(tout) < 0) {
    *err = "unsupported dtype code";
    return nullptr;
  }
  Plan* plan = new Plan();
  JETRL_CHECK(cublasLtMatmulDescCreate(&plan->desc, kComputeF32, kR32F));
  int32_t op_t = kOpT, op_n = kOpN;
  JETRL_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, kDescTransA, &op_t, sizeof(op_t)));
  JETRL_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, kDescTransB, &op_n, sizeof(op_n)));
  int32_t mode_a = b_blocks ? kScaleBlk128 : kScaleVec128, mode_b = kScaleVec128;
  JETRL_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, kDescAScaleMode, &mode_a,
                                             sizeof(mode_a)));
  JETRL_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, kDescBScaleMode, &mode_b,
                                             sizeof(mode_b)));
  // Placeholder scale pointers (16-byte aligned, never read here) so that the heuristic
  // sees a scaled problem.
  static const float kAligned[4] __attribute__((aligned(16))) = {1, 1, 1, 1};
  const void* any = kAligned;
  JETRL_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, kDescAScalePtr, &any, sizeof(any)));
  JETRL_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, kDescBScalePtr, &any, sizeof(any)));
  // A = b: C x Q column-major (ld C), transposed; B = a: C x P column-major (ld C).
  JETRL_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CudaType(tb), c, q, c));
  JETRL_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CudaType(ta), c, p, c));
  JETRL_CHECK(cublasLtMatrixLayoutCreate(&plan->d, CudaType(tout), q, p, q));
  cublasLtMatmulPreference_t pref = nullptr;
  JETRL_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  JETRL_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, kPrefMaxWorkspace, &workspace,
                                                   sizeof(workspace)));
  cublasLtMatmulHeuristicResult_t result;
  std::memset(&result, 0, sizeof(result));
  int returned = 0;
  cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(g_handle, plan->desc, plan->a, plan->b,
                                                    plan->d, plan->d, pref, 1, &result,
                                                    &returned);
  cublasLtMatmulPreferenceDestroy(pref);
  if (s != 0 || returned < 1) {
    *err = s != 0 ? Status("cublasLtMatmulAlgoGetHeuristic", s)
                  : std::string("cuBLASLt has no algorithm for this problem");
    cublasLtMatrixLayoutDestroy(plan->a);
    cublasLtMatrixLayoutDestroy(plan->b);
    cublasLtMatrixLayoutDestroy(plan->d);
    cublasLtMatmulDescDestroy(plan->desc);
    delete plan;
    return nullptr;
  }
  plan->algo = result.algo;
  (*g_plans)[key] = plan;
  return plan;
}

#undef JETRL_CHECK

ffi::Error Fp8BlockwiseGemm(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                            ffi::Buffer<ffi::F32> a_scale, ffi::Buffer<ffi::F32> b_scale,
                            ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::Buffer<ffi::U8>> workspace, int64_t b_blocks,
                            int64_t b_scale_ld) {
  auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  if (ad.size() != 2 || bd.size() != 2 || od.size() != 2 || ad[1] != bd[1] ||
      od[0] != ad[0] || od[1] != bd[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jetrl fp8 gemm: expected a [P, C], b [Q, C], out [P, Q]");
  }
  const int64_t p = ad[0], c = ad[1], q = bd[0];
  const int64_t cb = (c + 127) / 128;
  const int64_t want_sa = cb * p;
  const int64_t want_sb = b_blocks ? ((q + 127) / 128) * b_scale_ld : cb * q;
  if (static_cast<int64_t>(a_scale.element_count()) != want_sa ||
      static_cast<int64_t>(b_scale.element_count()) != want_sb ||
      (b_blocks && b_scale_ld < cb)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jetrl fp8 gemm: scale arrays do not match the operand shapes");
  }
  const int ta = CodeOf(a.element_type()), tb = CodeOf(b.element_type()),
            tout = CodeOf(out->element_type());
  if (ta < 0 || ta > 1 || tb < 0 || tb > 1 || tout < 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jetrl fp8 gemm: operands must be FP8 and the output bf16 or f32");
  }
  if (p == 0 || q == 0) return ffi::Error::Success();
  const uint64_t ws = workspace->element_count();
  std::string err;
  Plan* plan = GetPlan(p, q, c, ta, tb, tout, static_cast<int>(b_blocks), b_scale_ld, ws, &err);
  if (plan == nullptr) return ffi::Error(ffi::ErrorCode::kInternal, "jetrl fp8 gemm: " + err);
  const float alpha = 1.0f, beta = 0.0f;
  const void* pa = b_scale.untyped_data();  // A = b
  const void* pb = a_scale.untyped_data();  // B = a
  std::lock_guard<std::mutex> lock(plan->mu);
  cublasStatus_t s = cublasLtMatmulDescSetAttribute(plan->desc, kDescAScalePtr, &pa, sizeof(pa));
  if (s == 0) s = cublasLtMatmulDescSetAttribute(plan->desc, kDescBScalePtr, &pb, sizeof(pb));
  if (s == 0) {
    s = cublasLtMatmul(g_handle, plan->desc, &alpha, b.untyped_data(), plan->a,
                       a.untyped_data(), plan->b, &beta, out->untyped_data(), plan->d,
                       out->untyped_data(), plan->d, &plan->algo, workspace->untyped_data(),
                       ws, stream);
  }
  if (s != 0) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      "jetrl fp8 gemm: " + Status("cublasLtMatmul", s));
  }
  return ffi::Error::Success();
}

}  // namespace

// JETRL_FFI_HOST_TEST builds the handler for XLA's CPU backend, where the tests run it
// against a host-memory stand-in for cuBLASLt (tests/precision/cublaslt_host_stub.cc).
#ifdef JETRL_FFI_HOST_TEST
ffi::Error Fp8BlockwiseGemmHost(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::F32> sa,
                                ffi::Buffer<ffi::F32> sb, ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::U8>> ws, int64_t b_blocks,
                                int64_t b_scale_ld) {
  return Fp8BlockwiseGemm(nullptr, a, b, sa, sb, out, ws, b_blocks, b_scale_ld);
}
#define JETRL_IMPL Fp8BlockwiseGemmHost
#define JETRL_STREAM_CTX
#else
#define JETRL_IMPL Fp8BlockwiseGemm
#define JETRL_STREAM_CTX .Ctx<ffi::PlatformStream<cudaStream_t>>()
#endif

#define JETRL_BINDING                                 \
  ffi::Ffi::Bind()                                    \
      JETRL_STREAM_CTX                                \
      .Arg<ffi::AnyBuffer>()                          \
      .Arg<ffi::AnyBuffer>()                          \
      .Arg<ffi::Buffer<ffi::F32>>()                   \
      .Arg<ffi::Buffer<ffi::F32>>()                   \
      .Ret<ffi::AnyBuffer>()                          \
      .Ret<ffi::Buffer<ffi::U8>>()                    \
      .Attr<int64_t>("b_blocks")                      \
      .Attr<int64_t>("b_scale_ld")

// Two registrations of the same handler: one that XLA may record into CUDA graphs (command
// buffers), and one it must call eagerly.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JetrlFp8BlockwiseGemmGraph, JETRL_IMPL, JETRL_BINDING,
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JetrlFp8BlockwiseGemm, JETRL_IMPL, JETRL_BINDING);

// Host-side queries for Python (ctypes), usable before anything is traced.
extern "C" size_t jetrl_cublaslt_version() { return cublasLtGetVersion(); }

// 1 when cuBLASLt has an algorithm for this problem, else 0 and a message in err.
extern "C" int jetrl_cublaslt_supported(int64_t p, int64_t q, int64_t c, int ta, int tb,
                                        int tout, int b_blocks, int64_t b_ld,
                                        uint64_t workspace, char* err, int err_len) {
  std::string msg;
  Plan* plan = GetPlan(p, q, c, ta, tb, tout, b_blocks, b_ld, workspace, &msg);
  if (plan != nullptr) return 1;
  if (err != nullptr && err_len > 0) std::snprintf(err, err_len, "%s", msg.c_str());
  return 0;
}
