"""The compiled CPU kernels' build is named after what it was compiled for: a node of another CPU
model sharing the build folder (a home over NFS) compiles its own instead of loading one built
with instructions it lacks."""

from __future__ import annotations

from kernels import cpu_extension


def test_another_cpu_model_gets_another_build(monkeypatch) -> None:
    here = cpu_extension.build_name()
    assert cpu_extension.cpu_identity()  # the machine type at least
    monkeypatch.setattr(cpu_extension, "cpu_identity", lambda: "x86_64 fpu sse2 avx2")
    older = cpu_extension.build_name()
    monkeypatch.setattr(cpu_extension, "cpu_identity", lambda: "x86_64 fpu sse2 avx2 avx512f")
    newer = cpu_extension.build_name()
    assert len({here, older, newer}) == 3
    assert all(name.startswith("tandem_cpu_ops_") for name in (here, older, newer))
