"""What the Python benchmarks read of their own process and machine from /proc and lscpu: the
memory high-water mark (VmHWM) and its reset, the load average, the CPU model. Shared by
torch_ddp_compare.py, torch_fsdp_compare.py and grad_fusion_kernels.py, which import it from their own
folder."""
import subprocess


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def loadavg_1m() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def cpu_model() -> str:
    """lscpu's model name, or "?" where lscpu is missing or says none."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines() if l.startswith("Model name"))
    except (OSError, StopIteration):
        return "?"
