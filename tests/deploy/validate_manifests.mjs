// Offline validation of rendered Kubernetes manifests (the output of `kubectl kustomize` of an
// overlay in deploy/k8s/overlays/):
//  1. Schema: every object is validated against the JSON schema of its kind, generated from the
//     Kubernetes OpenAPI spec (npm `kubernetes-models`) or from the Prometheus Operator CRDs
//     (`@kubernetes-models/prometheus-operator`). A kind with no schema is an error, not a pass.
//  2. References: Services, NetworkPolicies and ServiceMonitors select pods/Services that exist
//     (and name ports that exist); volumes name Secrets/PVCs; the PrometheusRule's groups equal
//     deploy/prometheus/alerts.yml.
//  3. Policy (deploy issue): non-root pods, startup/readiness/liveness probes, CPU and memory
//     requests and limits on every container, who holds which credential (users' tokens and the
//     CA for the coordinator, the CA's certificate and a bootstrap token for workers, each from
//     its Secret), the worker and rank ports open to worker pods only, /metrics bound to an
//     address Prometheus reaches
//     (--metrics_host; the default is loopback), the workers' --checkpoint_root on the checkpoint
//     volume, scrape annotations, workers requesting nvidia.com/gpu when --expect-gpu is given.
// Usage: node validate_manifests.mjs [--expect-gpu] --alerts deploy/prometheus/alerts.yml FILE...
// Prints one line per problem and exits 1 when there is any.
import { readFileSync } from "node:fs";
import { isDeepStrictEqual } from "node:util";
import { parseAllDocuments, parse } from "yaml";

const args = process.argv.slice(2);
let expectGpu = false;
let alertsPath = null;
const files = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === "--expect-gpu") expectGpu = true;
  else if (args[i] === "--alerts") alertsPath = args[++i];
  else files.push(args[i]);
}
if (files.length === 0) {
  console.error("usage: node validate_manifests.mjs [--expect-gpu] [--alerts FILE] RENDERED.yaml...");
  process.exit(2);
}

const problems = [];
const problem = (where, what) => problems.push(`${where}: ${what}`);

// apiVersion + kind -> module path of its model class.
function modelPath(apiVersion, kind) {
  const [group, version] = apiVersion.includes("/") ? apiVersion.split("/") : ["", apiVersion];
  if (group === "monitoring.coreos.com") {
    return `@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`;
  }
  return `kubernetes-models/${group ? `${group}/` : ""}${version}/${kind}`;
}

const objects = [];
for (const file of files) {
  for (const doc of parseAllDocuments(readFileSync(file, "utf8"))) {
    if (doc.errors.length) {
      problem(file, `YAML: ${doc.errors.map((e) => e.message).join("; ")}`);
      continue;
    }
    const obj = doc.toJS();
    if (obj === null) continue;
    objects.push({ file, obj, where: `${file}: ${obj.kind}/${obj.metadata?.name}` });
  }
}

// 1. Schemas.
for (const { obj, where } of objects) {
  if (!obj.apiVersion || !obj.kind) {
    problem(where, "no apiVersion or kind");
    continue;
  }
  let Model;
  try {
    Model = (await import(modelPath(obj.apiVersion, obj.kind)))[obj.kind];
  } catch (e) {
    problem(where, `no schema for ${obj.apiVersion} ${obj.kind}`);
    continue;
  }
  try {
    new Model(obj).validate();
  } catch (e) {
    problem(where, `schema: ${e.message}`);
  }
  if (obj.kind !== "Namespace" && !obj.metadata?.namespace) problem(where, "no namespace");
}

// 2. and 3. References and policy.
const byKind = (kind) => objects.filter((o) => o.obj.kind === kind);
const workloads = objects.filter((o) => ["StatefulSet", "DaemonSet", "Deployment"].includes(o.obj.kind));
const matches = (selector, labels) =>
  Object.entries(selector ?? {}).every(([k, v]) => (labels ?? {})[k] === v);
const podLabels = (w) => w.obj.spec.template.metadata?.labels ?? {};
const containerPorts = (w) =>
  w.obj.spec.template.spec.containers.flatMap((c) => c.ports ?? []);

for (const w of workloads) {
  const pod = w.obj.spec.template.spec;
  if (!matches(w.obj.spec.selector?.matchLabels, podLabels(w))) {
    problem(w.where, "selector does not match the pod template's labels");
  }
  if (pod.securityContext?.runAsNonRoot !== true) problem(w.where, "pod not runAsNonRoot");
  if (!(pod.securityContext?.runAsUser > 0)) problem(w.where, "pod runAsUser not a non-root uid");
  const ann = w.obj.spec.template.metadata?.annotations ?? {};
  if (ann["prometheus.io/scrape"] !== "true") problem(w.where, "no prometheus.io/scrape annotation");
  const scrapePort = Number(ann["prometheus.io/port"]);
  if (!containerPorts(w).some((p) => p.containerPort === scrapePort)) {
    problem(w.where, `prometheus.io/port ${ann["prometheus.io/port"]} is no container port`);
  }
  for (const c of pod.containers) {
    const cw = `${w.where} container ${c.name}`;
    for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      if (!c[probe]) problem(cw, `no ${probe}`);
    }
    for (const side of ["requests", "limits"]) {
      for (const res of ["cpu", "memory"]) {
        if (!c.resources?.[side]?.[res]) problem(cw, `no resources.${side}.${res}`);
      }
    }
    if (/:latest$/.test(c.image) || !c.image.includes(":")) problem(cw, `image ${c.image} has no pinned tag`);
    if (c.securityContext?.allowPrivilegeEscalation !== false) problem(cw, "allowPrivilegeEscalation not false");
    const mounts = c.volumeMounts ?? [];
    for (const m of mounts) {
      const inPod = (pod.volumes ?? []).some((v) => v.name === m.name) ||
        (w.obj.spec.volumeClaimTemplates ?? []).some((t) => t.metadata.name === m.name);
      if (!inPod) problem(cw, `volumeMount ${m.name} names no volume`);
    }
    const cargs = c.args ?? [];
    const isWorker = w.obj.kind === "DaemonSet";
    if (cargs.some((a) => a.startsWith("--metrics_port=")) &&
        !cargs.some((a) => a.startsWith("--metrics_host=") && !/=127\.|=localhost/.test(a))) {
      problem(cw, "no --metrics_host: /metrics binds loopback by default, out of Prometheus' reach");
    }
    if (isWorker) {
      const root = cargs.find((a) => a.startsWith("--checkpoint_root="))?.split("=")[1];
      const mount = root && mounts.find((m) => m.mountPath === root || root.startsWith(`${m.mountPath}/`));
      const vol = mount && (pod.volumes ?? []).find((v) => v.name === mount.name);
      if (!vol?.persistentVolumeClaim) problem(cw, `--checkpoint_root ${root} is not on the checkpoint volume`);
    }
    // Who holds what (docs/security.md): the coordinator reads the users' tokens (--users_file
    // from the spindle-users Secret, or --token_file from spindle-token), its CA (--ca_cert and
    // --ca_key from spindle-ca) and the bootstrap tokens (spindle-bootstrap); a worker holds the
    // CA's certificate (never its key) and a bootstrap token, and no users' token.
    const secretOf = (flag) => {
      const path = flag.slice(flag.indexOf("=") + 1);
      const mount = mounts.find((m) => path.startsWith(`${m.mountPath}/`));
      const vol = mount && (pod.volumes ?? []).find((v) => v.name === mount.name);
      return [path, vol?.secret?.secretName];
    };
    const fromSecret = (flag, secret) => {
      const f = cargs.find((a) => a.startsWith(`${flag}=`));
      if (!f) problem(cw, `no ${flag}`);
      else if (secretOf(f)[1] !== secret) problem(cw, `${flag} ${secretOf(f)[0]} is not mounted from the ${secret} Secret`);
    };
    if (cargs.includes("--plaintext")) problem(cw, "--plaintext: workers would not be who their certificates say");
    if (cargs.some((a) => a.startsWith("--worker_token_file="))) {
      problem(cw, "--worker_token_file: workers hold certificates, not tokens");
    }
    if (isWorker) {
      fromSecret("--tls_ca_file", "spindle-ca");
      fromSecret("--bootstrap_token_file", "spindle-bootstrap");
      if (cargs.some((a) => a.startsWith("--token_file="))) problem(cw, "a worker holds a --token_file");
      for (const v of pod.volumes ?? []) {
        if (v.secret?.secretName === "spindle-ca" &&
            !(v.secret.items?.length && v.secret.items.every((i) => i.key === "ca.pem"))) {
          problem(cw, `volume ${v.name} gives the worker the CA's key (project only ca.pem)`);
        }
      }
    } else {
      const users = cargs.find((a) => a.startsWith("--users_file=")) ?? cargs.find((a) => a.startsWith("--token_file="));
      if (!users) problem(cw, "no --users_file or --token_file");
      else if (!["spindle-users", "spindle-token"].includes(secretOf(users)[1])) {
        problem(cw, `${users.split("=")[0]} ${secretOf(users)[0]} is not mounted from the spindle-users or spindle-token Secret`);
      }
      fromSecret("--ca_cert", "spindle-ca");
      fromSecret("--ca_key", "spindle-ca");
      fromSecret("--bootstrap_token_file", "spindle-bootstrap");
      if (!cargs.some((a) => a.startsWith("--worker_listen="))) {
        problem(cw, "no --worker_listen: the worker port must be one a NetworkPolicy can keep to worker pods");
      }
    }
    for (const probe of [c.startupProbe, c.readinessProbe, c.livenessProbe].filter(Boolean)) {
      const port = probe.httpGet?.port ?? probe.grpc?.port ?? probe.tcpSocket?.port;
      if (port !== undefined && !(c.ports ?? []).some((p) => p.name === port || p.containerPort === port)) {
        problem(cw, `probe port ${port} is no container port`);
      }
    }
  }
  for (const v of pod.volumes ?? []) {
    if (v.persistentVolumeClaim &&
        !byKind("PersistentVolumeClaim").some((p) => p.obj.metadata.name === v.persistentVolumeClaim.claimName)) {
      problem(w.where, `volume ${v.name} names no PersistentVolumeClaim ${v.persistentVolumeClaim.claimName}`);
    }
  }
}

const coordinator = byKind("StatefulSet").find((s) => s.obj.metadata.name === "spindle-coordinator");
const worker = byKind("DaemonSet").find((d) => d.obj.metadata.name === "spindle-worker");
if (!coordinator) problem("manifests", "no StatefulSet spindle-coordinator");
if (!worker) problem("manifests", "no DaemonSet spindle-worker");
if (coordinator && !(coordinator.obj.spec.volumeClaimTemplates ?? []).length) {
  problem(coordinator.where, "no volumeClaimTemplates for the SQLite store");
}
if (coordinator) {
  const args = coordinator.obj.spec.template.spec.containers[0].args ?? [];
  const db = args.find((a) => a.startsWith("--db="))?.split("=")[1] ?? "";
  const mounts = coordinator.obj.spec.template.spec.containers[0].volumeMounts ?? [];
  const claim = mounts.find((m) => db.startsWith(`${m.mountPath}/`));
  if (!claim || !(coordinator.obj.spec.volumeClaimTemplates ?? []).some((t) => t.metadata.name === claim.name)) {
    problem(coordinator.where, `--db ${db} is not on the claimed volume`);
  }
}
if (worker) {
  const pvc = (worker.obj.spec.template.spec.volumes ?? []).find((v) => v.persistentVolumeClaim);
  const claim = pvc && byKind("PersistentVolumeClaim").find((p) => p.obj.metadata.name === pvc.persistentVolumeClaim.claimName);
  if (!claim?.obj.spec.accessModes.includes("ReadWriteMany")) {
    problem(worker.where, "the checkpoint volume is not a ReadWriteMany claim");
  }
  const c = worker.obj.spec.template.spec.containers[0];
  const gpus = c.resources?.limits?.["nvidia.com/gpu"];
  if (expectGpu && !(Number(gpus) > 0)) problem(worker.where, "workers request no nvidia.com/gpu");
  if (expectGpu && !worker.obj.spec.template.spec.nodeSelector) problem(worker.where, "workers not pinned to GPU nodes");
  if (!expectGpu && gpus !== undefined) problem(worker.where, "CPU workers request nvidia.com/gpu");
  const coordArg = (c.args ?? []).find((a) => a.startsWith("--coordinator="));
  const coordSvc = coordArg?.split("=")[1].split(":")[0];
  const coordPort = Number(coordArg?.split(":")[1]);
  const svc = byKind("Service").find((s) => s.obj.metadata.name === coordSvc);
  if (!svc || !svc.obj.spec.ports.some((p) => p.port === coordPort)) {
    problem(worker.where, `--coordinator ${coordArg} names no Service port`);
  } else if (!coordinator || !matches(svc.obj.spec.selector, podLabels(coordinator))) {
    problem(worker.where, `Service ${coordSvc} does not select the coordinator`);
  }
}

for (const s of byKind("Service")) {
  const targets = workloads.filter((w) => matches(s.obj.spec.selector, podLabels(w)));
  if (!targets.length) problem(s.where, "selects no pods");
  for (const p of s.obj.spec.ports) {
    const t = p.targetPort ?? p.port;
    if (!targets.every((w) => containerPorts(w).some((cp) => cp.name === t || cp.containerPort === t))) {
      problem(s.where, `targetPort ${t} is no container port of the selected pods`);
    }
  }
}
for (const n of byKind("NetworkPolicy")) {
  if (!workloads.some((w) => matches(n.obj.spec.podSelector?.matchLabels, podLabels(w)))) {
    problem(n.where, "podSelector selects no pods");
  }
}
for (const w of workloads) {
  if (!byKind("NetworkPolicy").some((n) => matches(n.obj.spec.podSelector?.matchLabels, podLabels(w)))) {
    problem(w.where, "no NetworkPolicy selects these pods");
  }
}
// The coordinator's worker port, and every port of the workers but /metrics (the trainers' NCCL
// and Gloo ports), admit worker pods only.
// A peer's podSelector admits worker pods only when it names labels the worker pods carry and no
// other workload's pods do: an empty one (or one without labels) admits every pod of the namespace.
const workerPodsOnly = (selector) => {
  const labels = selector?.matchLabels ?? {};
  return Object.keys(labels).length > 0 && !selector.matchExpressions && worker !== undefined &&
    matches(labels, podLabels(worker)) &&
    workloads.every((w) => w === worker || !matches(labels, podLabels(w)));
};
const fromWorkersOnly = (rule) =>
  (rule.from ?? []).length > 0 &&
  rule.from.every((f) => !f.namespaceSelector && !f.ipBlock && workerPodsOnly(f.podSelector));
if (coordinator) {
  const args = coordinator.obj.spec.template.spec.containers[0].args ?? [];
  const workerPort = Number(args.find((a) => a.startsWith("--worker_listen="))?.split(":").pop());
  for (const n of byKind("NetworkPolicy").filter((n) => matches(n.obj.spec.podSelector?.matchLabels, podLabels(coordinator)))) {
    for (const rule of n.obj.spec.ingress ?? []) {
      const ports = (rule.ports ?? []).map((p) => p.port);
      if ((!rule.ports || ports.includes(workerPort)) && !fromWorkersOnly(rule)) {
        problem(n.where, `admits the worker port ${workerPort} from more than worker pods`);
      }
    }
  }
}
if (worker) {
  for (const n of byKind("NetworkPolicy").filter((n) => matches(n.obj.spec.podSelector?.matchLabels, podLabels(worker)))) {
    for (const rule of n.obj.spec.ingress ?? []) {
      const ports = (rule.ports ?? []).map((p) => p.port);
      if ((!rule.ports || ports.some((p) => p !== 9401)) && !fromWorkersOnly(rule)) {
        problem(n.where, "admits the workers' rank ports from more than worker pods");
      }
    }
  }
}

const monitors = byKind("ServiceMonitor");
if (!monitors.length) problem("manifests", "no ServiceMonitor");
for (const m of monitors) {
  const svcs = byKind("Service").filter((s) => matches(m.obj.spec.selector?.matchLabels, s.obj.metadata.labels));
  if (svcs.length !== 1) problem(m.where, `selects ${svcs.length} Services, want exactly 1`);
  for (const e of m.obj.spec.endpoints) {
    if (!svcs.every((s) => s.obj.spec.ports.some((p) => p.name === e.port))) {
      problem(m.where, `endpoint port ${e.port} is no port of the selected Service`);
    }
  }
}

if (alertsPath) {
  const alerts = parse(readFileSync(alertsPath, "utf8"));
  const rules = byKind("PrometheusRule");
  if (rules.length !== 1) problem("manifests", `${rules.length} PrometheusRules, want 1`);
  for (const r of rules) {
    if (!isDeepStrictEqual(r.obj.spec.groups, alerts.groups)) {
      problem(r.where, `groups differ from ${alertsPath}: edit both together`);
    }
  }
}

for (const p of problems) console.log(p);
console.log(`${files.join(", ")}: ${objects.length} objects, ${problems.length} problems`);
process.exit(problems.length ? 1 : 0);
