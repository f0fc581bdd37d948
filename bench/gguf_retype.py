"""Rewrite one tensor of a GGUF file in another type, everything else copied as it is.

llama.cpp's ``llama-quantize`` stores a 4-bit model's LM head wider than its body (Q6_K, or
what ``--output-tensor-type`` names); the shared SmolLM2 file's head is Q8_0, whose blocks an
int4 export keeps. This writes the same file with its head in F16 (or F32, BF16, Q8_0,
Q5_0, Q5_1, Q4_0, Q4_1: the types gguf-py can quantize to) so that the export's handling of
other wide heads can be measured on a real model (``bench/bench_gguf_fidelity.py --gguf``):

    python bench/gguf_retype.py SmolLM2-135M-Instruct.Q4_1.gguf out/smollm2-f16head.gguf \\
        --tensor token_embd.weight --type F16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def retype(src: Path, out: Path, tensor: str, kind: str) -> None:
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"]
    writer = gguf.GGUFWriter(str(out), arch=bytes(arch.parts[arch.data[0]]).decode(),
                             endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    target, data = Q[kind], {}
    for t in reader.tensors:
        if t.name != tensor:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes,
                                   t.tensor_type)
            data[t.name] = t.data
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if target in (Q.F32, Q.F16):
            new = values.astype(np.float32 if target == Q.F32 else np.float16)
        else:
            new = gguf.quants.quantize(values, target)
        writer.add_tensor_info(t.name, new.shape, new.dtype, new.nbytes, target)
        data[t.name] = new
    if tensor not in data:
        raise SystemExit(f"{src} has no tensor {tensor!r}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(data[t.name])
    writer.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--tensor", default="token_embd.weight")
    p.add_argument("--type", default="F16")
    a = p.parse_args(argv)
    retype(a.src, a.out, a.tensor, a.type)
    print(f"wrote {a.out} ({a.tensor} as {a.type})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
