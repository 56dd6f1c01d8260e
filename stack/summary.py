"""What `meridian up` prints once the stack is ready: what runs, where, the key, and examples to
copy and paste (curl, and the `openai` client verifying the stack's CA)."""

from __future__ import annotations

from pathlib import Path

from stack.layout import StackLayout


def count(num: int, noun: str) -> str:
    return f"{num} {noun}" + ("" if num == 1 else "s")


def render_summary(
    layout: StackLayout, model: str, api_key: str, ca_cert: str, state_dir: Path
) -> str:
    """What `up` prints once everything is ready: what runs, where, the key, and copy-paste
    examples (starting mid-sentence: "Meridian is up: " goes before it)."""
    base = layout.gateway_url + "/v1"
    num_envoys = sum(region.envoy_port is not None for region in layout.regions)
    names = ", ".join(region.name for region in layout.regions)
    return f"""{count(len(layout.regions), "region")} ({names}), \
{count(len(layout.nodes), "node agent")}, {count(num_envoys, "Envoy")}, \
gateway at PoP {layout.gateway_pop}.

  Gateway   {base}
  API key   {api_key}   (shown once; a new one on every `meridian up`)
  CA cert   {ca_cert}
  Admin     {layout.control_plane_url}   (tokens in {state_dir / "tokens.env"})
  Logs      {state_dir / "logs"}/

Try it:

curl --cacert {ca_cert} {base}/chat/completions \\
  -H "Authorization: Bearer {api_key}" -H "Content-Type: application/json" \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

python - <<'EOF'
import ssl, httpx, openai
client = openai.OpenAI(
    base_url="{base}", api_key="{api_key}",
    http_client=httpx.Client(verify=ssl.create_default_context(cafile="{ca_cert}")))
for chunk in client.chat.completions.create(
        model="{model}", stream=True,
        messages=[{{"role": "user", "content": "What is the capital of France?"}}]):
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
EOF

`meridian status` shows the fleet; `meridian down` stops it."""


def served_model(model: str) -> str:
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else model
