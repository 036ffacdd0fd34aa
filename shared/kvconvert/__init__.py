"""KV format migration: layout, dtype and block-size conversion; safetensors export/import."""
