//! Records libtorch's folder as a run path so that binaries and tests built
//! here find `libtorch_cpu.so` without LD_LIBRARY_PATH (on GPU hosts
//! LD_LIBRARY_PATH, searched first, points at the host's PyTorch), and
//! compiles the small C++ shim for libtorch settings tch does not expose
//! (and for libtorch's Gloo process group, the drafter group's CPU collectives,
//! and for its Kineto profiler).

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-changed=csrc/sdp.cpp");
    println!("cargo:rerun-if-changed=csrc/adamw.cpp");
    println!("cargo:rerun-if-changed=csrc/split_attention.cpp");
    println!("cargo:rerun-if-changed=csrc/gloo_group.cpp");
    println!("cargo:rerun-if-changed=csrc/varlen_attention.cpp");
    println!("cargo:rerun-if-changed=csrc/profiler.cpp");
    println!("cargo:rerun-if-changed=csrc/host_memory.cpp");
    println!("cargo:rerun-if-changed=csrc/fp8_linear.cpp");
    println!("cargo:rerun-if-changed=csrc/block_conv.cpp");
    println!("cargo:rerun-if-changed=csrc/fused_layers.cpp");
    println!("cargo:rerun-if-env-changed=DFLASH_GLOO_INCLUDE");
    let Ok(dir) = std::env::var("LIBTORCH") else {
        panic!("LIBTORCH is not set: run scripts/setup-libtorch.sh (the Makefile does)");
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}/lib");
    // Gloo's headers (libtorch's own Gloo is what runs; the wheel lacks them).
    let Ok(gloo) = std::env::var("DFLASH_GLOO_INCLUDE") else {
        panic!("DFLASH_GLOO_INCLUDE is not set: run scripts/setup-gloo-headers.sh (the Makefile does)");
    };
    if !std::path::Path::new(&gloo).join("gloo/context.h").exists() {
        panic!("{gloo} holds no Gloo headers: run scripts/setup-gloo-headers.sh (the Makefile does)");
    }
    cc::Build::new()
        .cpp(true)
        .file("csrc/sdp.cpp")
        .file("csrc/adamw.cpp")
        .file("csrc/split_attention.cpp")
        .file("csrc/gloo_group.cpp")
        .file("csrc/varlen_attention.cpp")
        .file("csrc/profiler.cpp")
        .file("csrc/host_memory.cpp")
        .file("csrc/fp8_linear.cpp")
        .file("csrc/block_conv.cpp")
        .file("csrc/fused_layers.cpp")
        .define("USE_C10D_GLOO", None)
        .include(gloo)
        .include(format!("{dir}/include"))
        .include(format!("{dir}/include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false)
        .compile("dflash_sdp");
}
