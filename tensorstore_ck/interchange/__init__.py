"""Snapshots in and out as other formats: torch.save and safetensors files, Hugging Face
model folders, a picture of the store's usage.

    export.py         a snapshot out as one safetensors / torch.save file (`tsck checkout`);
                      the model's weights alone (export_weights, `tsck export-weights`)
    importing.py      torch.save, safetensors files and model folders in (`tsck import`)
    hf_folder.py      the Hugging Face model folder (save_pretrained's layout, meta "hf")
                      and the safetensors view of a state
    plot.py           `tsck du --plot`: the store's usage as a picture

Each room imports only those listed below it (pyproject.toml, import-linter).
"""
