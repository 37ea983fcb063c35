"""Writes a copy of attention_mma.cu whose decode kernel stamps per-warp times
into g_trace (see attention_trace.cu). Usage: make_traced.py IN.cu OUT.cu"""
import sys
src = open(sys.argv[1]).read()
def rep(a, b):
    global src
    assert src.count(a) == 1, a
    src = src.replace(a, b)
rep('__device__ __forceinline__ uint32_t smem_address', '''__device__ unsigned long long g_trace[4096 * 8];
__device__ __forceinline__ unsigned long long gtimer() { unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ unsigned smid() { unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s; }
#define TRACE(slot, value) if (lane == 0) g_trace[(((t * p.num_kv_heads + kv_head) * gridDim.z + split) * 4 + warp) * 8 + (slot)] = (value)
__device__ __forceinline__ uint32_t smem_address''')
rep('''  const int group = p.num_q_heads / p.num_kv_heads;
  const int pos = p.positions[t];''', '''  const int group = p.num_q_heads / p.num_kv_heads;
  TRACE(0, gtimer()); TRACE(1, clock64()); TRACE(6, smid());
  const int pos = p.positions[t];''')
rep('''  asm volatile("griddepcontrol.wait;\\n" ::: "memory");
  uint32_t qa''', '''  asm volatile("griddepcontrol.wait;\\n" ::: "memory");
  TRACE(7, clock64());
  uint32_t qa''')
rep('''    __syncwarp();
    const unsigned char* k_tile''', '''    __syncwarp();
    if (i == 0) TRACE(2, clock64());
    const unsigned char* k_tile''')
rep('''  asm volatile("cp.async.wait_group 0;\\n" ::);  // nothing''', '''  TRACE(3, clock64());
  asm volatile("cp.async.wait_group 0;\\n" ::);  // nothing''')
rep('''\n}\n\n// One block per (token, q head)''', '''\n  TRACE(4, clock64()); TRACE(5, gtimer());\n}\n\n// One block per (token, q head)''')
open(sys.argv[2], 'w').write(src)
