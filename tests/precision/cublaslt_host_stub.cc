// A host-memory stand-in for the cuBLASLt entry points that jetrl's FP8 GEMM handler calls,
// implementing cuBLAS's documented contract (column-major operands, op(A) / op(B) transposes,
// leading dimensions, alpha / beta) and the VEC128 / BLK128x128 scale layouts, in float64.
// The CPU tests load it in place of libcublasLt to check the handler's and the Python
// wrapper's plumbing (shapes, operand order, leading dimensions, scale layouts, dtypes)
// against a numpy reference; the GPU tests check the real library.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

struct Desc {
  int transa = 0, transb = 0, a_mode = 0, b_mode = 0;
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
};
struct Layout {
  int type;
  uint64_t rows, cols;
  int64_t ld;
};

double DecodeFp8(uint8_t v, int type) {
  const int sign = v >> 7;
  double mag;
  if (type == 28) {  // E4M3 (fn): bias 7, 3 mantissa bits, 0x7f / 0xff NaN
    const int e = (v >> 3) & 0xF, m = v & 7;
    if (e == 15 && m == 7) return NAN;
    mag = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  } else {  // E5M2: bias 15, 2 mantissa bits
    const int e = (v >> 2) & 0x1F, m = v & 3;
    if (e == 31) return m == 0 ? INFINITY : NAN;
    mag = e == 0 ? std::ldexp(m / 4.0, -14) : std::ldexp(1.0 + m / 4.0, e - 15);
  }
  return sign ? -mag : mag;
}

uint16_t ToBf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return 0x7fc0;
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

extern "C" {
typedef int cublasStatus_t;

cublasStatus_t cublasLtCreate(void** handle) { *handle = reinterpret_cast<void*>(1); return 0; }
size_t cublasLtGetVersion(void) { return 130100; }
const char* cublasLtGetStatusString(cublasStatus_t) { return "stub error"; }
cublasStatus_t cublasLtMatmulDescCreate(Desc** desc, int compute, int scale) {
  if (compute != 68 || scale != 0) return 7;  // CUBLAS_COMPUTE_32F, CUDA_R_32F only
  *desc = new Desc();
  return 0;
}
cublasStatus_t cublasLtMatmulDescDestroy(Desc* desc) { delete desc; return 0; }
cublasStatus_t cublasLtMatmulDescSetAttribute(Desc* d, int attr, const void* buf, size_t size) {
  int32_t v = 0;
  if (size == 4) std::memcpy(&v, buf, 4);
  switch (attr) {
    case 3: d->transa = v; break;
    case 4: d->transb = v; break;
    case 31: d->a_mode = v; break;
    case 32: d->b_mode = v; break;
    case 17: std::memcpy(&d->a_scale, buf, sizeof(void*)); break;
    case 18: std::memcpy(&d->b_scale, buf, sizeof(void*)); break;
    default: return 7;
  }
  return 0;
}
cublasStatus_t cublasLtMatrixLayoutCreate(Layout** l, int type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
  *l = new Layout{type, rows, cols, ld};
  return 0;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(Layout* l) { delete l; return 0; }
cublasStatus_t cublasLtMatmulPreferenceCreate(void** p) { *p = new int(0); return 0; }
cublasStatus_t cublasLtMatmulPreferenceDestroy(void* p) { delete static_cast<int*>(p); return 0; }
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(void*, int, const void*, size_t) { return 0; }

// FP8 needs "TN", FP8 operands with 16-byte aligned leading dimensions, and 1x128 or
// 128x128 scale modes (A) / 1x128 (B); anything else has no algorithm.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(void*, Desc* d, Layout* a, Layout* b, Layout* c,
                                              Layout* dd, void*, int, void* results,
                                              int* returned) {
  const bool ok = d->transa == 1 && d->transb == 0 && (a->type == 28 || a->type == 29) &&
                  (b->type == 28 || b->type == 29) && a->ld % 16 == 0 && b->ld % 16 == 0 &&
                  (d->a_mode == 4 || d->a_mode == 5) && d->b_mode == 4 &&
                  (dd->type == 14 || dd->type == 0) && c->type == dd->type;
  *returned = ok ? 1 : 0;
  if (ok) std::memset(results, 0, 96);
  return 0;
}

// D (m x n) = alpha * op(A) (m x k) op(B) (k x n) + beta * C, column-major.
cublasStatus_t cublasLtMatmul(void*, Desc* d, const float* alpha, const uint8_t* A, Layout* la,
                              const uint8_t* B, Layout* lb, const float* beta, const void*,
                              Layout*, void* D, Layout* ld, const void*, void*, size_t, void*) {
  const int64_t m = d->transa ? la->cols : la->rows, k = d->transa ? la->rows : la->cols;
  const int64_t n = d->transb ? lb->rows : lb->cols;
  const int64_t kb_count = (k + 127) / 128, blk_ld = ((kb_count + 3) / 4) * 4;
  std::vector<double> acc(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double total = 0.0;
      for (int64_t kb = 0; kb < kb_count; ++kb) {
        double part = 0.0;
        for (int64_t kk = kb * 128; kk < std::min<int64_t>(k, kb * 128 + 128); ++kk) {
          const uint8_t av = d->transa ? A[kk + i * la->ld] : A[i + kk * la->ld];
          const uint8_t bv = d->transb ? B[j + kk * lb->ld] : B[kk + j * lb->ld];
          part += DecodeFp8(av, la->type) * DecodeFp8(bv, lb->type);
        }
        const double sa = d->a_mode == 5 ? d->a_scale[(i / 128) * blk_ld + kb]
                                         : d->a_scale[kb * m + i];
        const double sb = d->b_scale[kb * n + j];
        total += sa * sb * part;
      }
      acc[i + j * m] = total;
    }
  }
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const float v = static_cast<float>(*alpha * acc[i + j * m]);
      (void)beta;
      if (ld->type == 14) {
        static_cast<uint16_t*>(D)[i + j * ld->ld] = ToBf16(v);
      } else {
        static_cast<float*>(D)[i + j * ld->ld] = v;
      }
    }
  }
  return 0;
}
}  // extern "C"
