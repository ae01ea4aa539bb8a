"""Where the delta rule's UT prep spends its time on a GPU, without a kernel
profiler (the device machines have neither nsys nor ncu): the kernels of
common/models/csrc/delta_rule.cu compiled by NVRTC as the crate compiles
them, launched through the CUDA driver on a packed batch shaped like a
bench-capture batch (sequences of 550-3,072 tokens, about 8,100 in all,
Qwen3.5-35B-A3B's 16 key / 32 value heads of 128), timed with CUDA events.

Printed: the kernel time of ut_prep_tc and output_tc (bf16 and f32 inputs),
and ut_prep_tc's phases as clock64() stamps of each block's thread 0 after
each barrier (a copy of the source with the stamps inserted at its
barriers; the stamps do not change what the kernel computes).

    python3 scripts/device/profile_ut_prep.py [source.cu ...]

Each extra source (a variant of delta_rule.cu) is timed and compared with
the first for equal outputs.
"""
import ctypes
import glob
import os
import random
import sys

import torch

ROOT = os.path.dirname(os.path.abspath(__file__)) + "/../.."
SOURCES = sys.argv[1:] or [ROOT + "/common/models/csrc/delta_rule.cu"]
L, DK, DV, H, HK = 64, 128, 128, 32, 16


def nvrtc_lib():
    base = os.path.dirname(os.path.dirname(torch.__file__))
    for pattern in ("nvidia/cu13/lib/libnvrtc.so*", "nvidia/cuda_nvrtc/lib/libnvrtc.so*", "nvidia/*/lib/libnvrtc.so*"):
        for path in sorted(glob.glob(os.path.join(base, pattern))):
            if "builtins" not in path and "alt" not in path:
                return ctypes.CDLL(path)
    return ctypes.CDLL("libnvrtc.so")


NVRTC = nvrtc_lib()
CU = ctypes.CDLL("libcuda.so.1")


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: error {rc}")


def compile_cubin(src, defines):
    prog = ctypes.c_void_p()
    check(NVRTC.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"delta_rule.cu", 0, None, None), "create")
    major, minor = torch.cuda.get_device_capability()
    opts = [f"--gpu-architecture=sm_{major}{minor}", "--std=c++17"] + defines
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = NVRTC.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    NVRTC.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        raise RuntimeError(log.value.decode())
    NVRTC.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    check(NVRTC.nvrtcGetCUBIN(prog, cubin), "cubin")
    return cubin


class Module:
    def __init__(self, src, bf16):
        defines = [f"-DDK={DK}", f"-DDV={DV}", "-DBV=32", f"-DIN_BF16={int(bf16)}", "-DTC=1"]
        self.cubin = compile_cubin(src, defines)
        self.mod = ctypes.c_void_p()
        check(CU.cuModuleLoadData(ctypes.byref(self.mod), self.cubin), "load")

    def func(self, name, smem):
        f = ctypes.c_void_p()
        check(CU.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()), name)
        check(CU.cuFuncSetAttribute(f, 8, smem), "smem attribute")  # MAX_DYNAMIC_SHARED_SIZE_BYTES
        return f

    def global_ptr(self, name):
        p, n = ctypes.c_uint64(), ctypes.c_size_t()
        check(CU.cuModuleGetGlobal_v2(ctypes.byref(p), ctypes.byref(n), self.mod, name.encode()), name)
        return p.value, n.value


def launch(f, grid, smem, args):
    holders = []
    for a in args:
        if isinstance(a, torch.Tensor):
            holders.append(ctypes.c_uint64(a.data_ptr()))
        elif isinstance(a, float):
            holders.append(ctypes.c_float(a))
        else:
            holders.append(ctypes.c_int(a))
    params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    check(CU.cuLaunchKernel(f, grid[0], grid[1], 1, 256, 1, 1, smem, stream, params, None), "launch")


def elapsed_ms(f, repeats=20):
    for _ in range(3):
        f()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def batch(seed=0, budget=8134):
    random.seed(seed)
    lens = []
    while sum(lens) < budget - 550:
        lens.append(min(random.randint(550, 3072), budget - sum(lens)))
    tok, ln, t0 = [], [], 0
    for n in lens:
        for c in range(0, n, L):
            tok.append(t0 + c)
            ln.append(min(L, n - c))
        t0 += n
    return t0, torch.tensor(tok, dtype=torch.long, device="cuda"), torch.tensor(ln, dtype=torch.long, device="cuda")


STAMPS = 6


def stamped(src):
    """ut_prep_tc with clock64() stamps of thread 0 at its phase boundaries
    (after the barriers that end each phase)."""
    head, sep, body = src.partition("ut_prep_tc(")
    end = body.index("\nextern \"C\"")
    kernel, rest = body[:end], body[end:]

    def stamp(n):
        return f"    if (threadIdx.x == 0) ut_stamps[(blockIdx.y * gridDim.x + blockIdx.x) * {STAMPS} + {n}] = clock64();\n"

    anchors = [
        ("{\n", "after", 0),
        ("decay_prefix(gi, Gs); // starts and ends with a barrier\n    }\n", "after", 1),
        ("Gc[base * L + i] = Gs[i];\n    __syncthreads();\n", "after", 2),
        ("    __syncthreads();\n    // Thread (r, cc)", "barrier", 3),
        ("    // U = T (beta v), W = T", "before", 4),
    ]
    for text, where, n in anchors:
        at = kernel.index(text)
        if where == "after":
            at += len(text)
        elif where == "barrier":
            at += len("    __syncthreads();\n")
        kernel = kernel[:at] + stamp(n) + kernel[at:]
    last = kernel.rstrip().rfind("}")
    kernel = kernel[:last] + "    __syncthreads();\n" + stamp(STAMPS - 1) + kernel[last:]
    decl = f"__device__ long long ut_stamps[{STAMPS} * 65536];\n"
    cut = head.rindex("extern \"C\"")
    return head[:cut] + decl + head[cut:] + sep + kernel + rest


def main():
    torch.manual_seed(0)
    T, tok, ln = batch()
    C = tok.numel()
    print(f"{torch.cuda.get_device_name()}: {T} tokens, {C} chunks, {H} value / {HK} key heads of {DK}")
    smem_ut = (L * (DK + 4) + L * (DV + 8) + 2 * L * 68 + 16 * (L - 12) + 2 * L) * 4
    smem_out = (2 * L * (DK + 4) + L * 68 + L) * 4
    g = -torch.rand(T, H, device="cuda") * 0.1
    beta = torch.rand(T, H, device="cuda")
    results = {}
    for bf16 in (True, False):
        dt = torch.bfloat16 if bf16 else torch.float32
        k = torch.nn.functional.normalize(torch.randn(T, HK, DK, device="cuda"), dim=-1).to(dt)
        q = torch.nn.functional.normalize(torch.randn(T, HK, DK, device="cuda"), dim=-1).to(dt)
        v = torch.randn(T, H, DV, device="cuda").to(dt)
        for i, path in enumerate(SOURCES):
            src = open(path).read()
            m = Module(src, bf16)
            U = torch.empty(C * H * L * DV, device="cuda")
            W = torch.empty(C * H * L * DK, device="cuda")
            Gc = torch.empty(C * H * L, device="cuda")
            ut = m.func("ut_prep_tc", smem_ut)
            args = [k, v, g, beta, tok, ln, H, HK, U, W, Gc]
            ms = elapsed_ms(lambda: launch(ut, (C, H), smem_ut, args))
            S = torch.randn(C * H * DK * DV, device="cuda") * 0.01
            o = torch.empty(T * H * DV, device="cuda")
            out = m.func("output_tc", smem_out)
            oargs = [q, k, U, Gc, S, tok, ln, H, HK, o]
            oms = elapsed_ms(lambda: launch(out, (C, H), smem_out, oargs))
            moved = (k.numel() * H // HK + v.numel()) * k.element_size() + (U.numel() + W.numel()) * 4
            label = f"{os.path.basename(path)} {'bf16' if bf16 else 'f32'}"
            print(f"{label}: ut_prep_tc {ms:.3f} ms ({moved / ms / 1e6:.0f} GB/s of its traffic), output_tc {oms:.3f} ms")
            key = "bf16" if bf16 else "f32"
            if i == 0:
                results[key] = (U.clone(), W.clone(), Gc.clone())
            else:
                ref = results[key]
                same = all(torch.equal(a, b) for a, b in zip(ref, (U, W, Gc)))
                diff = max((a - b).abs().max().item() for a, b in zip(ref, (U, W, Gc)))
                print(f"  outputs equal to {os.path.basename(SOURCES[0])}'s: {same} (max difference {diff:.3e})")
            if i == 0:
                sm = Module(stamped(src), bf16)
                sut = sm.func("ut_prep_tc", smem_ut)
                sms = elapsed_ms(lambda: launch(sut, (C, H), smem_ut, args), repeats=5)
                ptr, n = sm.global_ptr("ut_stamps")
                host = torch.empty(C * H * STAMPS, dtype=torch.int64)
                check(CU.cuMemcpyDtoH_v2(ctypes.c_void_p(host.data_ptr()), ctypes.c_uint64(ptr), host.numel() * 8), "copy")
                st = host.view(C * H, STAMPS).double()
                d = (st[:, 1:] - st[:, :-1]).median(0).values.tolist()
                total = (st[:, -1] - st[:, 0]).median().item()
                print(f"  stamped copy {sms:.3f} ms; median cycles a block: {total:.0f} =",
                      " + ".join(f"{x:.0f}" for x in d),
                      "(load + decay | gram + A | diagonal inverses + scaling | block rows | U, W products + stores)")


main()
