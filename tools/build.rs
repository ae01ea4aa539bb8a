//! Records libtorch's folder as a run path so that binaries and tests built
//! here find `libtorch_cpu.so` without LD_LIBRARY_PATH. On GPU hosts
//! LD_LIBRARY_PATH (searched first) points at the host's PyTorch instead.

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Ok(dir) = std::env::var("LIBTORCH") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}/lib");
    }
}
