// ringcore's element-wise CUDA kernels: reductions and fp16 compression.
//
// Rules (the same as ringcore/kernels/numpy_ops.py, which is the reference;
// results are bitwise identical, NaN payloads included):
//   * Python picks every type: the kernel rc_combine<D, A, B, L, C, OP> loads
//     a and b, widens them exactly to the loop type L (what numpy's ufunc
//     would loop in), applies OP in L, casts to the accumulator C, divides by
//     the world size in C when `scale` (avg), and narrows to D.
//   * Narrowing rounds to nearest, ties to even. float16 arithmetic is done
//     as numpy does it: in float32, rounded to float16 once.
//   * NaNs propagate as numpy does on x86-64: add/mul/div return the NaN
//     operand quieted (the first for float32/float64, the second for float16,
//     whose loops numpy compiles with the operands swapped); an invalid
//     operation (inf - inf, 0 * inf) gives the x86 default NaN (negative,
//     quiet); min/max return an operand unchanged: float32/float64 as
//     `a < b || isnan(a) ? a : b`, float16 as `a <= b || isnan(a) ? a : b`.
//     Conversions keep the payload (float16 <-> float32/64 shift it; bfloat16
//     sets the quiet bit).
//   * Integers wrap around (arithmetic in the unsigned type of the same width).
//
// This file has no #include: NVRTC compiles it as is. The element rules
// (everything above the kernels) are also plain C++, so the tests compile
// them on the host with g++ and compare against numpy bit for bit; on the
// device the float conversions use the hardware instructions instead (also
// round-to-nearest-even), with NaNs handled in software as on the host.

#ifndef __CUDACC__
#define __host__
#define __device__
#define __forceinline__ inline
#endif

#define RC_FN __host__ __device__ __forceinline__

typedef unsigned char rc_u8;
typedef unsigned short rc_u16;
typedef unsigned int rc_u32;
typedef unsigned long long rc_u64;
typedef signed char rc_i8;
typedef short rc_i16;
typedef int rc_i32;
typedef long long rc_i64;

struct rc_f16 { rc_u16 bits; };
struct rc_bf16 { rc_u16 bits; };

enum { RC_SUM = 0, RC_PROD = 1, RC_MIN = 2, RC_MAX = 3 };

// ----------------------------------------------------------------- bit access

RC_FN rc_u32 f32_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    union { float f; rc_u32 u; } v; v.f = x; return v.u;
#endif
}
RC_FN float bits_f32(rc_u32 x) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(x);
#else
    union { float f; rc_u32 u; } v; v.u = x; return v.f;
#endif
}
RC_FN rc_u64 f64_bits(double x) {
#ifdef __CUDA_ARCH__
    return (rc_u64)__double_as_longlong(x);
#else
    union { double f; rc_u64 u; } v; v.f = x; return v.u;
#endif
}
RC_FN double bits_f64(rc_u64 x) {
#ifdef __CUDA_ARCH__
    return __longlong_as_double((long long)x);
#else
    union { double f; rc_u64 u; } v; v.u = x; return v.f;
#endif
}

RC_FN bool nan32(float x) { return (f32_bits(x) & 0x7fffffffu) > 0x7f800000u; }
RC_FN bool nan64(double x) { return (f64_bits(x) & 0x7fffffffffffffffull) > 0x7ff0000000000000ull; }
RC_FN bool nan16(rc_f16 x) { return (x.bits & 0x7fffu) > 0x7c00u; }
RC_FN float quiet32(float x) { return bits_f32(f32_bits(x) | 0x00400000u); }
RC_FN double quiet64(double x) { return bits_f64(f64_bits(x) | 0x0008000000000000ull); }

#define RC_DEFAULT_NAN32 0xffc00000u
#define RC_DEFAULT_NAN64 0xfff8000000000000ull

// ----------------------------------------------------------------- conversions

// float16 -> float32/float64 is exact; a NaN keeps its payload, shifted up.
RC_FN float f16_to_f32(rc_f16 h) {
    rc_u32 sign = (rc_u32)(h.bits & 0x8000u) << 16;
    if ((h.bits & 0x7c00u) == 0x7c00u) {  // inf or NaN
        return bits_f32(sign | 0x7f800000u | ((rc_u32)(h.bits & 0x3ffu) << 13));
    }
#ifdef __CUDA_ARCH__
    float out;
    asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(h.bits));
    return out;
#else
    rc_u32 exp = (h.bits >> 10) & 0x1fu, mant = h.bits & 0x3ffu;
    if (exp == 0) {
        if (mant == 0) return bits_f32(sign);
        int shift = 0;  // subnormal: normalise
        while (!(mant & 0x400u)) { mant <<= 1; ++shift; }
        return bits_f32(sign | ((rc_u32)(113 - shift) << 23) | ((mant & 0x3ffu) << 13));
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
#endif
}

RC_FN double f16_to_f64(rc_f16 h) {
    if ((h.bits & 0x7c00u) == 0x7c00u) {
        rc_u64 sign = (rc_u64)(h.bits & 0x8000u) << 48;
        return bits_f64(sign | 0x7ff0000000000000ull | ((rc_u64)(h.bits & 0x3ffu) << 42));
    }
#ifdef __CUDA_ARCH__
    double out;
    asm("cvt.f64.f16 %0, %1;" : "=d"(out) : "h"(h.bits));
    return out;
#else
    return (double)f16_to_f32(h);  // exact
#endif
}

// NaN -> float16 as numpy does: the payload's top bits, kept non-zero.
RC_FN rc_f16 nan_to_f16(rc_u16 sign, rc_u32 top_payload) {
    rc_u16 out = (rc_u16)(0x7c00u + top_payload);
    if (out == 0x7c00u) ++out;
    rc_f16 h = {(rc_u16)(sign | out)};
    return h;
}

#ifndef __CUDA_ARCH__
// Round a finite double to float16, nearest-even (host path; exact for float32 inputs too).
inline rc_f16 host_f64_to_f16(double x) {
    rc_u64 bits = f64_bits(x);
    rc_u16 sign = (rc_u16)((bits >> 48) & 0x8000u);
    rc_u64 mag = bits & 0x7fffffffffffffffull;
    int exp = (int)(mag >> 52);
    rc_u64 mant = mag & 0xfffffffffffffull;
    if (exp == 0x7ff) { rc_f16 h = {(rc_u16)(sign | 0x7c00u)}; return h; }  // inf
    int e = exp - 1023 + 15;  // float16 biased exponent
    if (e >= 31) { rc_f16 h = {(rc_u16)(sign | 0x7c00u)}; return h; }
    rc_u64 sig = mant | (exp ? (1ull << 52) : 0);  // 53-bit significand
    int shift = 42;  // normal: keep 11 bits
    if (e <= 0) {
        shift = 42 + 1 - e;  // subnormal: fewer bits
        e = 0;
        if (shift > 63) { rc_f16 h = {sign}; return h; }
    }
    rc_u64 kept = sig >> shift, rest = sig & ((1ull << shift) - 1), half = 1ull << (shift - 1);
    if (rest > half || (rest == half && (kept & 1))) ++kept;
    // kept includes the implicit bit for normals; adding carries into the exponent naturally
    rc_u32 out = e ? (((rc_u32)(e - 1) << 10) + (rc_u32)kept) : (rc_u32)kept;
    if (out >= 0x7c00u) out = 0x7c00u;
    rc_f16 h = {(rc_u16)(sign | out)};
    return h;
}
#endif

RC_FN rc_f16 f32_to_f16(float x) {
    rc_u32 bits = f32_bits(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return nan_to_f16((rc_u16)((bits >> 16) & 0x8000u), (bits & 0x7fffffu) >> 13);
#ifdef __CUDA_ARCH__
    rc_f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
#else
    return host_f64_to_f16((double)x);
#endif
}

RC_FN rc_f16 f64_to_f16(double x) {
    rc_u64 bits = f64_bits(x);
    if ((bits & 0x7fffffffffffffffull) > 0x7ff0000000000000ull)
        return nan_to_f16((rc_u16)((bits >> 48) & 0x8000u), (rc_u32)((bits & 0xfffffffffffffull) >> 42));
#ifdef __CUDA_ARCH__
    rc_f16 h;
    asm("cvt.rn.f16.f64 %0, %1;" : "=h"(h.bits) : "d"(x));
    return h;
#else
    return host_f64_to_f16(x);
#endif
}

RC_FN float bf16_to_f32(rc_bf16 x) { return bits_f32((rc_u32)x.bits << 16); }

RC_FN rc_bf16 f32_to_bf16(float x) {
    rc_u32 bits = f32_bits(x);
    rc_bf16 out;
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        out.bits = (rc_u16)((bits >> 16) | 0x40u);
    } else {
        out.bits = (rc_u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
    return out;
}

// Cast<To>::from(x): exact widening or nearest-even narrowing, as numpy's casts.
template <class To> struct Cast {
    template <class From> static RC_FN To from(From x) { return (To)x; }  // integers: same type
};
template <> struct Cast<float> {
    static RC_FN float from(float x) { return x; }
    static RC_FN float from(rc_f16 x) { return f16_to_f32(x); }
    static RC_FN float from(rc_bf16 x) { return bf16_to_f32(x); }
};
template <> struct Cast<double> {
    static RC_FN double from(double x) { return x; }
    static RC_FN double from(rc_f16 x) { return f16_to_f64(x); }
};
template <> struct Cast<rc_f16> {
    static RC_FN rc_f16 from(rc_f16 x) { return x; }
    static RC_FN rc_f16 from(float x) { return f32_to_f16(x); }
    static RC_FN rc_f16 from(double x) { return f64_to_f16(x); }
    static RC_FN rc_f16 from(rc_bf16 x) { return f32_to_f16(bf16_to_f32(x)); }
};
template <> struct Cast<rc_bf16> {
    static RC_FN rc_bf16 from(rc_bf16 x) { return x; }
    template <class From> static RC_FN rc_bf16 from(From x) { return f32_to_bf16(Cast<float>::from(x)); }
};

// ----------------------------------------------------------------- IEEE arithmetic
// CuPy compiles with -ftz=true (flush subnormals to zero), which numpy never does. On the
// device every float32/float64 operation is therefore written as PTX without .ftz (and
// with an explicit rounding mode, so nothing is fused into a multiply-add).

#ifdef __CUDA_ARCH__
#define RC_BINARY(name, type, ptx, reg)                                                  \
    RC_FN type name(type a, type b) {                                                  \
        type r;                                                                        \
        asm(ptx " %0, %1, %2;" : "=" reg(r) : reg(a), reg(b));                         \
        return r;                                                                      \
    }
#define RC_COMPARE(name, type, ptx, reg)                                                 \
    RC_FN bool name(type a, type b) {                                                  \
        unsigned r;                                                                    \
        asm("{ .reg .pred p; " ptx " p, %1, %2; selp.u32 %0, 1, 0, p; }"               \
            : "=r"(r) : reg(a), reg(b));                                               \
        return r != 0;                                                                 \
    }
RC_BINARY(add32, float, "add.rn.f32", "f")
RC_BINARY(mul32, float, "mul.rn.f32", "f")
RC_BINARY(div32, float, "div.rn.f32", "f")
RC_BINARY(add64, double, "add.rn.f64", "d")
RC_BINARY(mul64, double, "mul.rn.f64", "d")
RC_BINARY(div64, double, "div.rn.f64", "d")
RC_COMPARE(lt32, float, "setp.lt.f32", "f")
RC_COMPARE(gt32, float, "setp.gt.f32", "f")
RC_COMPARE(le32, float, "setp.le.f32", "f")
RC_COMPARE(ge32, float, "setp.ge.f32", "f")
RC_COMPARE(lt64, double, "setp.lt.f64", "d")
RC_COMPARE(gt64, double, "setp.gt.f64", "d")
RC_FN float narrow32(double x) {
    float r;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(x));
    return r;
}
#else
inline float narrow32(double x) { return (float)x; }
inline float add32(float a, float b) { return a + b; }
inline float mul32(float a, float b) { return a * b; }
inline float div32(float a, float b) { return a / b; }
inline double add64(double a, double b) { return a + b; }
inline double mul64(double a, double b) { return a * b; }
inline double div64(double a, double b) { return a / b; }
inline bool lt32(float a, float b) { return a < b; }
inline bool gt32(float a, float b) { return a > b; }
inline bool le32(float a, float b) { return a <= b; }
inline bool ge32(float a, float b) { return a >= b; }
inline bool lt64(double a, double b) { return a < b; }
inline bool gt64(double a, double b) { return a > b; }
#endif

// ----------------------------------------------------------------- operations

RC_FN float arith32(int op, float a, float b) {
    if (nan32(a)) return quiet32(a);
    if (nan32(b)) return quiet32(b);
    float r = op == RC_SUM ? add32(a, b) : mul32(a, b);
    return nan32(r) ? bits_f32(RC_DEFAULT_NAN32) : r;
}
RC_FN double arith64(int op, double a, double b) {
    if (nan64(a)) return quiet64(a);
    if (nan64(b)) return quiet64(b);
    double r = op == RC_SUM ? add64(a, b) : mul64(a, b);
    return nan64(r) ? bits_f64(RC_DEFAULT_NAN64) : r;
}

template <int OP> struct Op;
template <int OP> struct ArithOp {
    static RC_FN float apply(float a, float b) { return arith32(OP, a, b); }
    static RC_FN double apply(double a, double b) { return arith64(OP, a, b); }
    static RC_FN rc_f16 apply(rc_f16 a, rc_f16 b) {  // numpy's float16 loop: operands swapped
        return f32_to_f16(arith32(OP, f16_to_f32(b), f16_to_f32(a)));
    }
    template <class T> static RC_FN T apply(T a, T b) {  // integers wrap around
        typedef decltype(0ull + a) Wide;
        return (T)(OP == RC_SUM ? (Wide)a + (Wide)b : (Wide)a * (Wide)b);
    }
};
template <> struct Op<RC_SUM> : ArithOp<RC_SUM> {};
template <> struct Op<RC_PROD> : ArithOp<RC_PROD> {};
template <> struct Op<RC_MIN> {
    static RC_FN float apply(float a, float b) { return (lt32(a, b) || nan32(a)) ? a : b; }
    static RC_FN double apply(double a, double b) { return (lt64(a, b) || nan64(a)) ? a : b; }
    static RC_FN rc_f16 apply(rc_f16 a, rc_f16 b) {
        return (le32(f16_to_f32(a), f16_to_f32(b)) || nan16(a)) ? a : b;
    }
    template <class T> static RC_FN T apply(T a, T b) { return a < b ? a : b; }
};
template <> struct Op<RC_MAX> {
    static RC_FN float apply(float a, float b) { return (gt32(a, b) || nan32(a)) ? a : b; }
    static RC_FN double apply(double a, double b) { return (gt64(a, b) || nan64(a)) ? a : b; }
    static RC_FN rc_f16 apply(rc_f16 a, rc_f16 b) {
        return (ge32(f16_to_f32(a), f16_to_f32(b)) || nan16(a)) ? a : b;
    }
    template <class T> static RC_FN T apply(T a, T b) { return a > b ? a : b; }
};

// avg's final division by the world size, in the accumulator type.
RC_FN float scale_by(float x, double world) { return nan32(x) ? quiet32(x) : div32(x, narrow32(world)); }
RC_FN double scale_by(double x, double world) { return nan64(x) ? quiet64(x) : div64(x, world); }
RC_FN rc_f16 scale_by(rc_f16 x, double world) {
    return f32_to_f16(scale_by(f16_to_f32(x), f16_to_f64(f32_to_f16(narrow32(world)))));
}
template <class T> RC_FN T scale_by(T x, double) { return x; }  // integers: avg is refused earlier

// One element of rc_combine: dst = narrow<D>(scale(cast<C>(op<L>(a, b)))).
template <class D, class A, class B, class L, class C, int OP>
RC_FN D combine_one(A a, B b, int scale, double world) {
    C acc = Cast<C>::from(Op<OP>::apply(Cast<L>::from(a), Cast<L>::from(b)));
    if (scale) acc = scale_by(acc, world);
    return Cast<D>::from(acc);
}

// One element of rc_convert: through M (float32 for bfloat16 sources, else S itself).
template <class D, class S, class M> RC_FN D convert_one(S s) { return Cast<D>::from(Cast<M>::from(s)); }

// ----------------------------------------------------------------- kernels

#ifdef __CUDACC__

// Elements per thread and iteration: 16 bytes of the widest operand.
template <class X, class Y, class Z> struct Width {
    static const int max_size = sizeof(X) > sizeof(Y) ? (sizeof(X) > sizeof(Z) ? sizeof(X) : sizeof(Z))
                                                      : (sizeof(Y) > sizeof(Z) ? sizeof(Y) : sizeof(Z));
    static const int value = 16 / max_size;
};

template <class T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

// Grid-stride loops: `head` leading elements one by one (until every pointer is
// aligned to its pack), then whole packs of V elements, then the tail.
template <class D, class A, class B, class L, class C, int OP>
__global__ void rc_combine(D* dst, const A* a, const B* b, long long n, long long head, int scale, double world) {
    const int V = Width<D, A, B>::value;
    long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = tid; i < head; i += stride) dst[i] = combine_one<D, A, B, L, C, OP>(a[i], b[i], scale, world);
    long long packs = (n - head) / V;
    const Pack<A, V>* pa = (const Pack<A, V>*)(a + head);
    const Pack<B, V>* pb = (const Pack<B, V>*)(b + head);
    Pack<D, V>* pd = (Pack<D, V>*)(dst + head);
    for (long long p = tid; p < packs; p += stride) {
        Pack<A, V> x = pa[p];
        Pack<B, V> y = pb[p];
        Pack<D, V> out;
#pragma unroll
        for (int j = 0; j < V; ++j) out.v[j] = combine_one<D, A, B, L, C, OP>(x.v[j], y.v[j], scale, world);
        pd[p] = out;
    }
    for (long long i = head + packs * V + tid; i < n; i += stride)
        dst[i] = combine_one<D, A, B, L, C, OP>(a[i], b[i], scale, world);
}

template <class D, class S, class M>
__global__ void rc_convert(D* dst, const S* src, long long n, long long head) {
    const int V = Width<D, S, S>::value;
    long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = tid; i < head; i += stride) dst[i] = convert_one<D, S, M>(src[i]);
    long long packs = (n - head) / V;
    const Pack<S, V>* ps = (const Pack<S, V>*)(src + head);
    Pack<D, V>* pd = (Pack<D, V>*)(dst + head);
    for (long long p = tid; p < packs; p += stride) {
        Pack<S, V> x = ps[p];
        Pack<D, V> out;
#pragma unroll
        for (int j = 0; j < V; ++j) out.v[j] = convert_one<D, S, M>(x.v[j]);
        pd[p] = out;
    }
    for (long long i = head + packs * V + tid; i < n; i += stride) dst[i] = convert_one<D, S, M>(src[i]);
}

#endif
