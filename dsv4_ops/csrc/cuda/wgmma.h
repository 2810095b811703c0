// Hopper warpgroup-MMA (wgmma) plumbing shared by the NVFP4 tile kernels and the prefill attention kernel (sm_90a
// PTX; no torch headers): fences, groups, shared-memory matrix descriptors.
#pragma once
#include <stdint.h>

namespace dsv4_cuda {

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The accumulators are written by the tensor cores behind the compiler's back: pin them after a wait.
template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// Generic-proxy writes (st.shared, cp.async) before wgmma reads them through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Shared-memory matrix descriptor in 128-byte swizzle atoms (8 rows x 128 B, 1 KB aligned): start address, the
// leading and stride byte offsets (>> 4 in the descriptor). K-major operand: lbo unused (16), sbo = the stride
// between 8-row groups. MN-major (transposed) operand: lbo = the stride between 64-element columns along M / N,
// sbo = the stride between groups of 8 rows along K.
__device__ __forceinline__ uint64_t smem_desc(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((saddr & 0x3FFFFu) >> 4) | (uint64_t((lbo >> 4) & 0x3FFFu) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFFu) << 32) | (uint64_t(1) << 62);
}

// wgmma.mma_async operand lists: the accumulators d[0 .. n) as "+f" operands and their "%i" names.
#define DSV4_WG_D8(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define DSV4_WG_R8 \
  "%0,%1,%2,%3,%4,%5,%6,%7"
#define DSV4_WG_D16(d) DSV4_WG_D8(d), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), \
  "+f"(d[15])
#define DSV4_WG_R16 DSV4_WG_R8 "," \
  "%8,%9,%10,%11,%12,%13,%14,%15"
#define DSV4_WG_D32(d) DSV4_WG_D16(d), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), \
  "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), \
  "+f"(d[30]), "+f"(d[31])
#define DSV4_WG_R32 DSV4_WG_R16 "," \
  "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
#define DSV4_WG_D64(d) DSV4_WG_D32(d), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), \
  "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), \
  "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), \
  "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), \
  "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define DSV4_WG_R64 DSV4_WG_R32 "," \
  "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55," \
  "%56,%57,%58,%59,%60,%61,%62,%63"
#define DSV4_WG_D128(d) DSV4_WG_D64(d), \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), \
  "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), \
  "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), \
  "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), \
  "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), \
  "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), \
  "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), \
  "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
  "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), \
  "+f"(d[127])
#define DSV4_WG_R128 DSV4_WG_R64 "," \
  "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87," \
  "%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108," \
  "%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127"
#define DSV4_WG_PRED "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"

// d[64 x N] += a (registers: this warp's 16 rows x 16 k, mma.sync's m16k16 A fragment) . B (shared memory,
// descriptor b: N rows x 16 k, K-major); bf16 in, fp32 accumulators d[N / 2].
template <int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b);
// One specialization: N, the accumulator operand list / names, the names of a[0..3] and of b.
#define DSV4_WG_RS(N, DL, RL, AN, BN)                                                                         \
  template <>                                                                                                  \
  __device__ __forceinline__ void wgmma_rs<N>(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {         \
    asm volatile(DSV4_WG_PRED "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" RL "}, {" AN "}, " BN \
                 ", p, 1, 1, 0;\n}"                                                                            \
                 : DL(d)                                                                                       \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                                        \
  }
DSV4_WG_RS(16, DSV4_WG_D8, DSV4_WG_R8, "%8,%9,%10,%11", "%12")
DSV4_WG_RS(32, DSV4_WG_D16, DSV4_WG_R16, "%16,%17,%18,%19", "%20")
DSV4_WG_RS(64, DSV4_WG_D32, DSV4_WG_R32, "%32,%33,%34,%35", "%36")
DSV4_WG_RS(128, DSV4_WG_D64, DSV4_WG_R64, "%64,%65,%66,%67", "%68")
#undef DSV4_WG_RS

// d[64 x N] += A (shared memory, descriptor a: 64 rows x 16 k, K-major) . B (descriptor b: K-major, or MN-major
// where TRANS_B); bf16 in, fp32 accumulators d[N / 2]. The shapes the kernels use.
template <int N, bool TRANS_B>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b);
// One specialization: N, TRANS_B as 0 / 1, the accumulator operand list / names, the names of a and b.
#define DSV4_WG_SS(N, TB, DL, RL, AN, BN)                                                                      \
  template <>                                                                                                  \
  __device__ __forceinline__ void wgmma_ss<N, TB != 0>(float (&d)[N / 2], uint64_t a, uint64_t b) {            \
    asm volatile(DSV4_WG_PRED "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" RL "}, " AN ", " BN \
                 ", p, 1, 1, 0, " #TB ";\n}"                                                                   \
                 : DL(d)                                                                                       \
                 : "l"(a), "l"(b));                                                                            \
  }
DSV4_WG_SS(32, 0, DSV4_WG_D16, DSV4_WG_R16, "%16", "%17")
DSV4_WG_SS(256, 1, DSV4_WG_D128, DSV4_WG_R128, "%128", "%129")
#undef DSV4_WG_SS

}  // namespace dsv4_cuda
