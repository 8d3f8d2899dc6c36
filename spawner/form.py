"""The options form: the site's choices, live availability from the scheduler, the last server's fate, and a
preview of the exact batch script and its GPU-hours that follows the fields as they change."""
from __future__ import annotations

from jinja2 import Environment

from .profile import Profile, format_walltime
from ..batchsystems.scheduler import Availability

_TEMPLATE = Environment(autoescape=True).from_string("""
<div class="hpcdl-form">
{% if last_end %}<div class="alert alert-warning hpcdl-last-end" role="alert">Your last server ended: {{ last_end }}</div>{% endif %}
<table class="table table-condensed hpcdl-availability">
  <thead><tr><th>Partition</th><th>Idle nodes</th><th>Idle GPUs</th><th>Limits</th></tr></thead>
  <tbody>{% for p in partitions %}<tr data-partition="{{ p.name }}"><td>{{ p.name }}{% if p.description %} — {{ p.description }}{% endif %}</td>
    <td>{{ avail[p.name].idle_nodes if p.name in avail else "?" }} / {{ avail[p.name].nodes if p.name in avail else "?" }}</td>
    <td>{{ avail[p.name].idle_gpus if p.name in avail else "?" }} / {{ avail[p.name].gpus if p.name in avail else "?" }}</td>
    <td>≤ {{ p.max_nodes }} nodes, ≤ {{ p.max_gpus_per_node }} GPUs/node, ≤ {{ walltime(p.max_walltime) }}{% if p.max_memory_gb %}, ≤ {{ p.max_memory_gb }} GB/node{% endif %}</td></tr>{% endfor %}</tbody>
</table>
<div class="form-group"><label for="hpcdl-partition">Partition</label>
  <select class="form-control" id="hpcdl-partition" name="partition">{% for p in partitions %}
    <option value="{{ p.name }}" data-max-nodes="{{ p.max_nodes }}" data-max-gpus="{{ p.max_gpus_per_node }}" data-max-memory="{{ p.max_memory_gb or '' }}"
      {% if p.name == defaults.partition %}selected{% endif %}>{{ p.name }}</option>{% endfor %}</select></div>
<div class="form-group"><label for="hpcdl-nodes">Nodes</label>
  <input class="form-control" type="number" id="hpcdl-nodes" name="nodes" min="1" value="{{ defaults.nodes }}"></div>
<div class="form-group"><label for="hpcdl-gpus">GPUs per node</label>
  <input class="form-control" type="number" id="hpcdl-gpus" name="gpus_per_node" min="0" value="{{ defaults.gpus_per_node }}"></div>
{% if gpu_types %}<div class="form-group"><label for="hpcdl-gpu-type">GPU type</label>
  <select class="form-control" id="hpcdl-gpu-type" name="gpu_type">{% for p in partitions if p.gpu_types %}{% for t in p.gpu_types %}
    <option value="{{ t }}" data-partition="{{ p.name }}" {% if p.name == defaults.partition and t == defaults.gpu_type %}selected{% endif %}>{{ t }} ({{ p.name }})</option>{% endfor %}{% endfor %}</select></div>{% endif %}
<div class="form-group"><label for="hpcdl-walltime">Walltime (HH:MM:SS)</label>
  <input class="form-control" type="text" id="hpcdl-walltime" name="walltime" value="{{ defaults.walltime }}"></div>
{% if memory %}<div class="form-group"><label for="hpcdl-memory">Memory per node (GB)</label>
  <input class="form-control" type="number" id="hpcdl-memory" name="memory_gb" min="1" value="{{ defaults.memory_gb or '' }}"></div>{% endif %}
{% if accounts %}<div class="form-group"><label for="hpcdl-account">Account</label>
  <select class="form-control" id="hpcdl-account" name="account">{% for a in accounts %}<option value="{{ a }}">{{ a }}</option>{% endfor %}</select></div>{% endif %}
<div class="form-group"><label for="hpcdl-image">Container image</label>
  <select class="form-control" id="hpcdl-image" name="image">{% for i in images %}
    <option value="{{ i.name }}">{{ i.name }} — {{ i.description or i.ref }}</option>{% endfor %}</select></div>
<p class="hpcdl-gpu-hours">This asks for <b id="hpcdl-gpu-hours">{{ preview.gpu_hours }}</b> GPU-hours.</p>
<p class="text-danger" id="hpcdl-preview-error" role="alert"></p>
<details open><summary>The batch script that will be submitted</summary>
<pre id="hpcdl-script" class="hpcdl-script" style="white-space: pre-wrap">{{ preview.script }}</pre></details>
</div>
<script>
(function () {
  var form = document.getElementById("hpcdl-partition").form;
  var field = form.querySelector("input[name=_xsrf]");
  var xsrf = field ? field.value : new URL(form.action, location.href).searchParams.get("_xsrf");
  var timer = null;
  function update() {
    var params = new URLSearchParams(new FormData(form));
    params.delete("_xsrf");
    params.set("server_name", {{ server_name|tojson }});
    fetch({{ preview_url|tojson }} + "?" + params.toString(),
          {headers: xsrf ? {"X-XSRFToken": xsrf} : {}, credentials: "same-origin"})
      .then(function (r) { return r.json().then(function (body) { return [r.ok, body]; }); })
      .then(function (res) {
        var err = document.getElementById("hpcdl-preview-error");
        if (res[0]) { document.getElementById("hpcdl-script").textContent = res[1].script;
                      document.getElementById("hpcdl-gpu-hours").textContent = res[1].gpu_hours; err.textContent = ""; }
        else { err.textContent = res[1].message || "not allowed"; }
      });
  }
  var types = document.getElementById("hpcdl-gpu-type");
  function gpuTypes() {  // only the chosen partition's GPU types and memory; none: the field is not sent
    var select = document.getElementById("hpcdl-partition"), memory = document.getElementById("hpcdl-memory");
    if (memory) {  // a partition that takes no memory request: the field is not sent
      var most = select.selectedOptions[0].dataset.maxMemory;
      memory.disabled = !most;
      if (most && !memory.value) { memory.value = most; }
    }
    if (!types) { return; }
    var partition = select.value, first = null;
    Array.prototype.forEach.call(types.options, function (o) {
      var mine = o.dataset.partition === partition;
      o.hidden = o.disabled = !mine;
      if (mine && first === null) { first = o; }
    });
    types.disabled = first === null;
    if (first !== null && types.selectedOptions[0] && types.selectedOptions[0].disabled) { first.selected = true; }
  }
  gpuTypes();
  form.addEventListener("input", function () { gpuTypes(); clearTimeout(timer); timer = setTimeout(update, 250); });
})();
</script>
""")


def render_form(profile: Profile, user: str, availability: dict[str, Availability], preview: dict,
                defaults: dict, preview_url: str, server_name: str = "", last_end: str = "") -> str:
    return _TEMPLATE.render(
        partitions=list(profile.partitions.values()), images=list(profile.images.values()),
        gpu_types=any(p.gpu_types for p in profile.partitions.values()),
        memory=any(p.max_memory_gb for p in profile.partitions.values()),
        accounts=profile.accounts_for(user), avail=availability, preview=preview, defaults=defaults,
        walltime=format_walltime, preview_url=preview_url, server_name=server_name, last_end=last_end)
