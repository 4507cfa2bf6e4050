// simt.h -- a small SIMT shim that lets the CUDA kernel sources (giftcomm/cuda/kernels/*.cu, the
// exact text giftcomm.cuda._loader gives NVRTC) compile as host C++ and run on the CPU.
//
// Model: the CTAs of a launch run one after the other; the threads of a CTA are cooperative
// fibers (ucontext) scheduled round robin on one OS thread. A fiber runs until it waits (a warp
// shuffle or __syncthreads whose partners have not arrived) or returns. Shared memory is a
// function-static (one CTA at a time). Warp shuffles check what the hardware leaves undefined
// (a lane outside the member mask, lanes whose masks disagree, a partner that exited) and report
// it as an error of the launch instead of inventing a value; a launch where every live thread
// waits is reported as a deadlock.
//
// Not modelled: __CUDA_ARCH__ (undefined here: the headers' host branches run, i.e. the portable
// FP8 conversion and plain C float arithmetic, which is IEEE without flush-to-zero), memory
// ordering between CTAs, timing.
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define GCEMU_ASAN 1
#else
#define GCEMU_ASAN 0
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
    unsigned x, y, z;
};

struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

namespace gcemu {

constexpr size_t kStack = 256 * 1024;
constexpr int kMaxThreads = 1024;

struct Fiber {
    ucontext_t ctx;
    dim3 tid;
    unsigned linear;
    bool done;
    // warp shuffles: the k-th shuffle of this lane posts into slot k & 1
    unsigned posted;  // number of shuffles posted
    uint32_t val[2];
    unsigned mask[2];
};

struct State {
    Fiber fibers[kMaxThreads];
    char* stacks = nullptr;
    ucontext_t sched;
    Fiber* cur = nullptr;
    unsigned nthreads = 0, live = 0;
    unsigned long long progress = 0;
    unsigned bar_count = 0, bar_gen = 0;
    dim3 block_idx{0, 0, 0}, block_dim{1, 1, 1}, grid_dim{1, 1, 1};
    std::function<void()>* body = nullptr;
    int error = 0;
    char msg[512];
#if GCEMU_ASAN
    void* fake_stack = nullptr;
    const void* sched_bottom = nullptr;
    size_t sched_size = 0;
#endif
};

inline State& S() {
    static State s;
    return s;
}

inline void fail(const char* what) {
    State& s = S();
    if (!s.error) {
        s.error = 1;
        const Fiber* f = s.cur;
        snprintf(s.msg, sizeof s.msg, "%s (block (%u,%u,%u), thread (%u,%u,%u))", what, s.block_idx.x, s.block_idx.y,
                 s.block_idx.z, f ? f->tid.x : 0u, f ? f->tid.y : 0u, f ? f->tid.z : 0u);
    }
}

// back to the scheduler (from a fiber)
inline void yield() {
    State& s = S();
    Fiber* f = s.cur;
#if GCEMU_ASAN
    void* fs = nullptr;
    __sanitizer_start_switch_fiber(&fs, s.sched_bottom, s.sched_size);
    swapcontext(&f->ctx, &s.sched);
    __sanitizer_finish_switch_fiber(fs, nullptr, nullptr);
#else
    swapcontext(&f->ctx, &s.sched);
#endif
    s.cur = f;
}

// wait (yielding) until cond() holds; a launch in error never returns here again
template <class C>
inline void wait_until(C cond) {
    while (!cond()) yield();
    S().progress++;
}

inline void fiber_main(int idx) {
    State& s = S();
#if GCEMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &s.sched_bottom, &s.sched_size);
#endif
    (*s.body)();
    Fiber& f = s.fibers[idx];
    f.done = true;
    s.live--;
    s.progress++;
    if (s.bar_count && s.bar_count >= s.live) {  // exited threads no longer hold a barrier back
        s.bar_count = 0;
        s.bar_gen++;
    }
#if GCEMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, s.sched_bottom, s.sched_size);  // this stack is done
#endif
    setcontext(&s.sched);
}

inline void syncthreads() {
    State& s = S();
    const unsigned gen = s.bar_gen;
    s.progress++;
    if (++s.bar_count >= s.live) {
        s.bar_count = 0;
        s.bar_gen++;
        return;
    }
    wait_until([&] { return s.bar_gen != gen; });
}

// mode 0 xor (bfly), 1 down, 2 up, 3 idx
inline uint32_t shfl(unsigned mask, uint32_t v, int mode, int arg, int width) {
    State& s = S();
    Fiber* f = s.cur;
    const unsigned lane = f->linear & 31u, base = f->linear & ~31u;
    if (width <= 0 || width > 32 || (width & (width - 1))) { fail("__shfl_*_sync: width not a power of two <= 32"); yield(); }
    if (!((mask >> lane) & 1u)) { fail("__shfl_*_sync: the calling lane is not in the member mask"); yield(); }
    const unsigned k = f->posted, slot = k & 1u;
    f->val[slot] = v;
    f->mask[slot] = mask;
    f->posted = k + 1;
    s.progress++;
    for (unsigned l = 0; l < 32; ++l) {
        if (!((mask >> l) & 1u)) continue;
        if (base + l >= s.nthreads) { fail("__shfl_*_sync: member mask names a lane beyond blockDim"); yield(); }
        Fiber* p = &s.fibers[base + l];
        wait_until([&] { return p->posted > k || p->done; });
        if (p->posted <= k) { fail("__shfl_*_sync: a lane of the member mask exited without shuffling"); yield(); }
        if (p->mask[slot] != mask) { fail("__shfl_*_sync: lanes called with different member masks"); yield(); }
    }
    const unsigned seg = lane & ~(unsigned)(width - 1), maxl = seg + (unsigned)width - 1u;
    int src;
    bool ok;
    switch (mode) {
        case 0: src = (int)(lane ^ (unsigned)arg); ok = (unsigned)src <= maxl; break;
        case 1: src = (int)lane + arg; ok = (unsigned)src <= maxl; break;
        case 2: src = (int)lane - arg; ok = src >= (int)seg; break;
        default: src = (int)(seg + ((unsigned)arg & (unsigned)(width - 1))); ok = true; break;
    }
    if (!ok) return v;
    if (!((mask >> src) & 1u)) { fail("__shfl_*_sync: source lane not in the member mask (undefined value)"); yield(); }
    return s.fibers[base + (unsigned)src].val[slot];
}

template <class T>
inline T shfl_t(unsigned mask, T v, int mode, int arg, int width) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    uint32_t u;
    memcpy(&u, &v, 4);
    u = shfl(mask, u, mode, arg, width);
    T r;
    memcpy(&r, &u, 4);
    return r;
}

// run one launch; 0 ok, else S().msg says why
inline int launch(const unsigned* grid, const unsigned* block, std::function<void()> body) {
    State& s = S();
    const unsigned nt = block[0] * block[1] * block[2];
    s.error = 0;
    s.msg[0] = 0;
    if (nt == 0 || nt > (unsigned)kMaxThreads || grid[0] * (unsigned long long)grid[1] * grid[2] == 0) {
        snprintf(s.msg, sizeof s.msg, "invalid launch configuration");
        return 1;
    }
    if (!s.stacks) s.stacks = (char*)malloc(kStack * kMaxThreads);
    s.body = &body;
    s.grid_dim = dim3{grid[0], grid[1], grid[2]};
    s.block_dim = dim3{block[0], block[1], block[2]};
    for (unsigned bz = 0; bz < grid[2] && !s.error; ++bz)
        for (unsigned by = 0; by < grid[1] && !s.error; ++by)
            for (unsigned bx = 0; bx < grid[0] && !s.error; ++bx) {
                s.block_idx = dim3{bx, by, bz};
                s.nthreads = s.live = nt;
                s.bar_count = 0;
                for (unsigned t = 0; t < nt; ++t) {
                    Fiber& f = s.fibers[t];
                    f.linear = t;
                    f.tid = dim3{t % block[0], (t / block[0]) % block[1], t / (block[0] * block[1])};
                    f.done = false;
                    f.posted = 0;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = s.stacks + (size_t)t * kStack;
                    f.ctx.uc_stack.ss_size = kStack;
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, (void (*)())fiber_main, 1, (int)t);
                }
                while (s.live && !s.error) {
                    const unsigned long long before = s.progress;
                    for (unsigned t = 0; t < nt && !s.error; ++t) {
                        Fiber& f = s.fibers[t];
                        if (f.done) continue;
                        s.cur = &f;
#if GCEMU_ASAN
                        void* fs = nullptr;
                        __sanitizer_start_switch_fiber(&fs, f.ctx.uc_stack.ss_sp, f.ctx.uc_stack.ss_size);
                        swapcontext(&s.sched, &f.ctx);
                        __sanitizer_finish_switch_fiber(fs, &s.sched_bottom, &s.sched_size);
#else
                        swapcontext(&s.sched, &f.ctx);
#endif
                    }
                    s.cur = nullptr;
                    if (!s.error && s.live && s.progress == before) {
                        snprintf(s.msg, sizeof s.msg, "deadlock: %u threads of block (%u,%u,%u) wait for each other",
                                 s.live, s.block_idx.x, s.block_idx.y, s.block_idx.z);
                        s.error = 1;
                    }
                }
            }
    s.body = nullptr;
    return s.error;
}

// ---------------------------------------------------------------- kernel signatures
// one token per parameter: pointers "<kind><bits>*" (f32*, u8*, i64* ...; "c" prefix for const
// pointees), scalars "<kind><bits>"
template <class T>
inline std::string scalar_code() {
    using U = typename std::remove_cv<T>::type;
    const char* k = std::is_floating_point<U>::value ? "f" : (std::is_signed<U>::value ? "i" : "u");
    return std::string(k) + std::to_string(8 * sizeof(U));
}
template <class T>
inline std::string param_code() {
    if constexpr (std::is_pointer<T>::value) {
        using P = typename std::remove_pointer<T>::type;
        if constexpr (std::is_same<typename std::remove_cv<P>::type, void>::value)
            return std::string(std::is_const<P>::value ? "c" : "") + "v*";
        else
            return std::string(std::is_const<P>::value ? "c" : "") + scalar_code<P>() + "*";
    } else {
        return scalar_code<T>();
    }
}
template <class... A>
inline std::string signature(void (*)(A...)) {
    std::string out;
    ((out += (out.empty() ? "" : ",") + param_code<A>()), ...);
    return out;
}

template <class... A, size_t... I>
inline int launch_kernel_impl(void (*k)(A...), const unsigned* grid, const unsigned* block, void** args,
                              std::index_sequence<I...>) {
    std::tuple<typename std::remove_cv<A>::type...> a{*static_cast<typename std::remove_cv<A>::type*>(args[I])...};
    return launch(grid, block, [&] { k(std::get<I>(a)...); });
}
template <class... A>
inline int launch_kernel(void (*k)(A...), const unsigned* grid, const unsigned* block, void** args) {
    return launch_kernel_impl(k, grid, block, args, std::index_sequence_for<A...>{});
}

}  // namespace gcemu

#include <string>

#define threadIdx (gcemu::S().cur->tid)
#define blockIdx (gcemu::S().block_idx)
#define blockDim (gcemu::S().block_dim)
#define gridDim (gcemu::S().grid_dim)
#define warpSize 32

inline void __syncthreads() { gcemu::syncthreads(); }
// a barrier of the lanes in the mask (each must call it): a shuffle whose value nobody uses
inline void __syncwarp(unsigned m = 0xFFFFFFFFu) { (void)gcemu::shfl(m, 0u, 3, (int)(gcemu::S().cur->linear & 31u), 32); }
template <class T>
inline T __shfl_xor_sync(unsigned m, T v, int lm, int w = 32) { return gcemu::shfl_t<T>(m, v, 0, lm, w); }
template <class T>
inline T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) { return gcemu::shfl_t<T>(m, v, 1, (int)d, w); }
template <class T>
inline T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) { return gcemu::shfl_t<T>(m, v, 2, (int)d, w); }
template <class T>
inline T __shfl_sync(unsigned m, T v, int src, int w = 32) { return gcemu::shfl_t<T>(m, v, 3, src, w); }
// one OS thread runs every fiber and a fiber only switches inside a shuffle or barrier: atomics are plain
inline unsigned atomicMax(unsigned* p, unsigned v) { const unsigned o = *p; if (v > o) *p = v; return o; }
inline int atomicMax(int* p, int v) { const int o = *p; if (v > o) *p = v; return o; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned o = *p; *p = o + v; return o; }
inline int atomicAdd(int* p, int v) { const int o = *p; *p = o + v; return o; }
inline float atomicAdd(float* p, float v) { const float o = *p; *p = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { const auto o = *p; *p = o + v; return o; }
