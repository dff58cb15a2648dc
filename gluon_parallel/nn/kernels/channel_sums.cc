// gluon_parallel: SyncBatchNorm's per-channel sums, and its affine output,
// one pass each way.
//
// gp_channel_sums(x), x of shape (pre, C, post) and dtype float16, float32 or
// float64, gives the float64 vector [S1 | S2 | q] (3C): q_c = x[0, c, 0] (the
// shift), S1_c = sum(x - q_c), S2_c = sum((x - q_c)^2) over pre and post,
// accumulated in float64. Backward: dx = dS1_c + 2 dS2_c (x - q_c) (q is a
// constant), in one pass.
//
// gp_centred_affine(x, q, scale, shift), x as above, q, scale and shift (C)
// float32 or float64 (one dtype), gives y = (x - q_c) * scale_c + shift_c in
// x's dtype, computed in float64 (so x - q is exact, as the sums' is).
// Backward: dx = dy scale_c, dscale_c = sum(dy (x - q_c)), dshift_c = sum(dy)
// (float64 accumulators), dq = 0 (q is a pivot, not a function of x here),
// in one pass. Built by gluon_parallel/nn/kernels/__init__.py
// against the MXNet wheel's lib_api.h and loaded with mx.library.load.
#include <cstdint>
#include <cstring>
#include <vector>
#include "mxnet/lib_api.h"

using namespace mxnet::ext;

namespace {

inline float half_to_float(uint16_t h) {
  uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, f;
  if (exp == 0) {
    if (mant == 0) { f = sign << 31; }
    else {  // subnormal
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) { mant <<= 1; --exp; }
      mant &= 0x3ff;
      f = (sign << 31) | (exp << 23) | (mant << 13);
    }
  } else if (exp == 31) {
    f = (sign << 31) | 0x7f800000 | (mant << 13);
  } else {
    f = (sign << 31) | ((exp - 15 + 127) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

inline uint16_t float_to_half(float v) {  // round to nearest even
  uint32_t f;
  std::memcpy(&f, &v, 4);
  uint32_t sign = (f >> 16) & 0x8000;
  int32_t exp = ((f >> 23) & 0xff) - 127 + 15;
  uint32_t mant = f & 0x7fffff;
  if (((f >> 23) & 0xff) == 0xff) return sign | 0x7c00 | (mant ? 0x200 : 0);
  if (exp >= 31) return sign | 0x7c00;
  if (exp <= 0) {
    if (exp < -10) return sign;
    mant |= 0x800000;
    uint32_t shift = 14 - exp;
    uint32_t half = mant >> shift, rem = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return sign | half;
  }
  uint32_t half = sign | (exp << 10) | (mant >> 13), rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return half;
}

template <typename T> inline double load(const T* p, int64_t i) { return static_cast<double>(p[i]); }
template <> inline double load<uint16_t>(const uint16_t* p, int64_t i) { return half_to_float(p[i]); }
template <typename T> inline void store(T* p, int64_t i, double v) { p[i] = static_cast<T>(v); }
template <> inline void store<uint16_t>(uint16_t* p, int64_t i, double v) {
  p[i] = float_to_half(static_cast<float>(v));
}

template <typename T>
void sums(const T* x, int64_t pre, int64_t C, int64_t post, double* out) {
  double* q = out + 2 * C;
  for (int64_t c = 0; c < C; ++c) {
    out[c] = 0;
    out[C + c] = 0;
    q[c] = load(x, c * post);
  }
  for (int64_t n = 0; n < pre; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      const T* row = x + (n * C + c) * post;
      const double shift = q[c];
      double s1 = 0, s2 = 0;
      for (int64_t k = 0; k < post; ++k) {
        const double v = load(row, k) - shift;
        s1 += v;
        s2 += v * v;
      }
      out[c] += s1;
      out[C + c] += s2;
    }
  }
}

template <typename T>
void sums_backward(const double* g, const double* q, const T* x, int64_t pre, int64_t C,
                   int64_t post, T* dx) {
  for (int64_t n = 0; n < pre; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      const int64_t base = (n * C + c) * post;
      const double a = g[c], b = 2 * g[C + c], shift = q[c];
      for (int64_t k = 0; k < post; ++k) store(dx, base + k, a + b * (load(x, base + k) - shift));
    }
  }
}

MXReturnValue parseAttrs(const std::unordered_map<std::string, std::string>& attrs,
                         int* num_in, int* num_out) {
  *num_in = 1;
  *num_out = 1;
  return MX_SUCCESS;
}

MXReturnValue inferType(const std::unordered_map<std::string, std::string>& attrs,
                        std::vector<int>* in, std::vector<int>* out) {
  if ((*in)[0] != kFloat32 && (*in)[0] != kFloat64 && (*in)[0] != kFloat16) {
    MX_ERROR_MSG << "gp_channel_sums: float16, float32 or float64 input";
    return MX_FAIL;
  }
  (*out)[0] = kFloat64;
  return MX_SUCCESS;
}

MXReturnValue inferShape(const std::unordered_map<std::string, std::string>& attrs,
                         std::vector<std::vector<unsigned int>>* in,
                         std::vector<std::vector<unsigned int>>* out) {
  if ((*in)[0].size() != 3) {
    MX_ERROR_MSG << "gp_channel_sums: input must be (pre, channels, post)";
    return MX_FAIL;
  }
  (*out)[0] = {3 * (*in)[0][1]};
  return MX_SUCCESS;
}

MXReturnValue forward(const std::unordered_map<std::string, std::string>& attrs,
                      std::vector<MXTensor>* inputs, std::vector<MXTensor>* outputs,
                      const OpResource& res) {
  MXTensor& x = (*inputs)[0];
  int64_t pre = x.shape[0], C = x.shape[1], post = x.shape[2];
  double* out = (*outputs)[0].data<double>();
  switch (x.dtype) {
    case kFloat32: sums(x.data<float>(), pre, C, post, out); break;
    case kFloat64: sums(x.data<double>(), pre, C, post, out); break;
    case kFloat16: sums(x.data<uint16_t>(), pre, C, post, out); break;
    default: return MX_FAIL;
  }
  return MX_SUCCESS;
}

// inputs: [d out, x, out]; outputs: [dx]
MXReturnValue backward(const std::unordered_map<std::string, std::string>& attrs,
                       std::vector<MXTensor>* inputs, std::vector<MXTensor>* outputs,
                       const OpResource& res) {
  const double* g = (*inputs)[0].data<double>();
  MXTensor& x = (*inputs)[1];
  const int64_t pre = x.shape[0], C = x.shape[1], post = x.shape[2];
  const double* q = (*inputs)[2].data<double>() + 2 * C;
  MXTensor& dx = (*outputs)[0];
  switch (x.dtype) {
    case kFloat32: sums_backward(g, q, x.data<float>(), pre, C, post, dx.data<float>()); break;
    case kFloat64: sums_backward(g, q, x.data<double>(), pre, C, post, dx.data<double>()); break;
    case kFloat16:
      sums_backward(g, q, x.data<uint16_t>(), pre, C, post, dx.data<uint16_t>()); break;
    default: return MX_FAIL;
  }
  return MX_SUCCESS;
}

template <typename T, typename P>
void affine(const T* x, const P* q, const P* scale, const P* shift, int64_t pre, int64_t C,
            int64_t post, T* y) {
  for (int64_t n = 0; n < pre; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      const int64_t base = (n * C + c) * post;
      const double a = scale[c], b = shift[c], p = q[c];
      for (int64_t k = 0; k < post; ++k) store(y, base + k, (load(x, base + k) - p) * a + b);
    }
  }
}

template <typename T, typename P>
void affine_backward(const T* dy, const T* x, const P* q, const P* scale, int64_t pre,
                     int64_t C, int64_t post, T* dx, P* dq, P* dscale, P* dshift) {
  std::vector<double> sd(C, 0.0), sdx(C, 0.0);
  for (int64_t n = 0; n < pre; ++n) {
    for (int64_t c = 0; c < C; ++c) {
      const int64_t base = (n * C + c) * post;
      const double a = scale[c], p = q[c];
      double s0 = 0, s1 = 0;
      for (int64_t k = 0; k < post; ++k) {
        const double g = load(dy, base + k);
        store(dx, base + k, g * a);
        s0 += g;
        s1 += g * (load(x, base + k) - p);
      }
      sd[c] += s0;
      sdx[c] += s1;
    }
  }
  for (int64_t c = 0; c < C; ++c) {
    dq[c] = 0;
    dscale[c] = static_cast<P>(sdx[c]);
    dshift[c] = static_cast<P>(sd[c]);
  }
}

MXReturnValue affineAttrs(const std::unordered_map<std::string, std::string>& attrs,
                          int* num_in, int* num_out) {
  *num_in = 4;
  *num_out = 1;
  return MX_SUCCESS;
}

MXReturnValue affineType(const std::unordered_map<std::string, std::string>& attrs,
                         std::vector<int>* in, std::vector<int>* out) {
  const int x = (*in)[0], p = (*in)[1];
  if (x != kFloat32 && x != kFloat64 && x != kFloat16) {
    MX_ERROR_MSG << "gp_centred_affine: float16, float32 or float64 data";
    return MX_FAIL;
  }
  if ((p != kFloat32 && p != kFloat64) || (*in)[2] != p || (*in)[3] != p) {
    MX_ERROR_MSG << "gp_centred_affine: q, scale and shift of one dtype, float32 or float64";
    return MX_FAIL;
  }
  (*out)[0] = x;
  return MX_SUCCESS;
}

MXReturnValue affineShape(const std::unordered_map<std::string, std::string>& attrs,
                          std::vector<std::vector<unsigned int>>* in,
                          std::vector<std::vector<unsigned int>>* out) {
  const std::vector<unsigned int>& x = (*in)[0];
  if (x.size() != 3) {
    MX_ERROR_MSG << "gp_centred_affine: data must be (pre, channels, post)";
    return MX_FAIL;
  }
  for (int i = 1; i < 4; ++i) {
    if ((*in)[i].size() != 1 || (*in)[i][0] != x[1]) {
      MX_ERROR_MSG << "gp_centred_affine: q, scale and shift must be (channels,)";
      return MX_FAIL;
    }
  }
  (*out)[0] = x;
  return MX_SUCCESS;
}

template <typename P>
MXReturnValue affineForwardP(std::vector<MXTensor>* inputs, MXTensor* y) {
  MXTensor& x = (*inputs)[0];
  const int64_t pre = x.shape[0], C = x.shape[1], post = x.shape[2];
  const P *q = (*inputs)[1].data<P>(), *a = (*inputs)[2].data<P>(), *b = (*inputs)[3].data<P>();
  switch (x.dtype) {
    case kFloat32: affine(x.data<float>(), q, a, b, pre, C, post, y->data<float>()); break;
    case kFloat64: affine(x.data<double>(), q, a, b, pre, C, post, y->data<double>()); break;
    case kFloat16: affine(x.data<uint16_t>(), q, a, b, pre, C, post, y->data<uint16_t>()); break;
    default: return MX_FAIL;
  }
  return MX_SUCCESS;
}

MXReturnValue affineForward(const std::unordered_map<std::string, std::string>& attrs,
                            std::vector<MXTensor>* inputs, std::vector<MXTensor>* outputs,
                            const OpResource& res) {
  return (*inputs)[1].dtype == kFloat64 ? affineForwardP<double>(inputs, &(*outputs)[0])
                                        : affineForwardP<float>(inputs, &(*outputs)[0]);
}

template <typename P>
MXReturnValue affineBackwardP(std::vector<MXTensor>* inputs, std::vector<MXTensor>* outputs) {
  MXTensor &dy = (*inputs)[0], &x = (*inputs)[1];
  const int64_t pre = x.shape[0], C = x.shape[1], post = x.shape[2];
  const P *q = (*inputs)[2].data<P>(), *a = (*inputs)[3].data<P>();
  MXTensor& dx = (*outputs)[0];
  P *dq = (*outputs)[1].data<P>(), *da = (*outputs)[2].data<P>(), *db = (*outputs)[3].data<P>();
  switch (x.dtype) {
    case kFloat32:
      affine_backward(dy.data<float>(), x.data<float>(), q, a, pre, C, post, dx.data<float>(),
                      dq, da, db);
      break;
    case kFloat64:
      affine_backward(dy.data<double>(), x.data<double>(), q, a, pre, C, post,
                      dx.data<double>(), dq, da, db);
      break;
    case kFloat16:
      affine_backward(dy.data<uint16_t>(), x.data<uint16_t>(), q, a, pre, C, post,
                      dx.data<uint16_t>(), dq, da, db);
      break;
    default: return MX_FAIL;
  }
  return MX_SUCCESS;
}

// inputs: [dy, x, q, scale, shift, y]; outputs: [dx, dq, dscale, dshift]
MXReturnValue affineBackward(const std::unordered_map<std::string, std::string>& attrs,
                             std::vector<MXTensor>* inputs, std::vector<MXTensor>* outputs,
                             const OpResource& res) {
  return (*inputs)[2].dtype == kFloat64 ? affineBackwardP<double>(inputs, outputs)
                                        : affineBackwardP<float>(inputs, outputs);
}

}  // namespace

REGISTER_OP(gp_centred_affine)
.setParseAttrs(affineAttrs)
.setInferType(affineType)
.setInferShape(affineShape)
.setForward(affineForward, "cpu")
.setBackward(affineBackward, "cpu");

REGISTER_OP(gp_channel_sums)
.setParseAttrs(parseAttrs)
.setInferType(inferType)
.setInferShape(inferShape)
.setForward(forward, "cpu")
.setBackward(backward, "cpu");

MXReturnValue initialize(int version) {
  return version >= 10900 ? MX_SUCCESS : MX_FAIL;
}
