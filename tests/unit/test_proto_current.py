"""The committed stubs in sidecar/v1/ must match what protoc generates from the proto today."""

import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED = ("sidecar_pb2.py", "sidecar_pb2.pyi", "sidecar_pb2_grpc.py")


def test_stubs_are_regenerated_from_current_proto(tmp_path):
    from grpc_tools import protoc

    proto_root = tmp_path / "proto"
    shutil.copytree(ROOT / "proto", proto_root)
    out = tmp_path / "out"
    out.mkdir()
    # Same invocation as `make proto`, run from a copy so relative paths match.
    args = [
        "protoc",
        f"-I{proto_root}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(proto_root / "sidecar" / "v1" / "sidecar.proto"),
    ]
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    args.insert(1, f"-I{include}")
    assert protoc.main(args) == 0, "protoc failed on proto/sidecar/v1/sidecar.proto"
    stale = []
    for name in GENERATED:
        fresh = (out / "sidecar" / "v1" / name).read_text()
        committed = (ROOT / "sidecar" / "v1" / name).read_text()
        if fresh != committed:
            stale.append(name)
    if stale:
        pytest.fail(
            f"sidecar/v1/{', '.join(stale)} out of date with proto/sidecar/v1/sidecar.proto: run `make proto`"
        )
