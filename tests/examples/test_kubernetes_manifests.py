"""examples/kubernetes/*.yaml are valid Kubernetes objects, checked with no cluster.

Debian has no kubeconform, so the relevant parts of the Kubernetes OpenAPI schemas (v1.29;
Deployment, Service, Job, Pod template, Container, EnvVar, Probe, Volume, ...) and Kubeflow's
PyTorchJob CRD (training-operator v1.7+) are written down below as JSON Schema and checked with
python3-jsonschema. Unknown fields are refused (`additionalProperties: false`), as
`kubectl apply` with strict field validation refuses them, so a misspelt key fails here.

Beyond the schemas, the manifests must hang together: selectors match their pod labels, the
Service's target ports and the probes' ports are named container ports, the probes use
/healthz and /readyz on the port named `metrics`, jobs reach the rendezvous through the
Service's name and port, and every flag and PET_ variable given to ddplaunch or ddp-rendezvous
is one the built binaries know (their --help). Mutated copies show each check can fail.

Runs on Debian's python3 (python3-yaml, python3-jsonschema from scripts/setup).
"""

import copy
import glob
import os
import re
import subprocess
import sys
import unittest

try:
    import jsonschema
    import yaml
except ImportError as e:  # scripts/setup installs both; without them this check cannot run
    sys.exit("test_kubernetes_manifests: %s: install python3-yaml and python3-jsonschema "
             "(scripts/setup does)" % e)

BUILD_DIR = os.environ.get("DDPLAUNCH_BUILD_DIR", "build")
SOURCE_DIR = os.environ.get("DDPLAUNCH_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
EXAMPLES = os.path.join(SOURCE_DIR, "examples", "kubernetes")
BINARIES = {name: os.path.join(os.path.abspath(BUILD_DIR), "bin", name) for name in ("ddplaunch", "ddp-rendezvous")}

# Flags the manifests use that another part adds (the metrics helper's
# `ddp-rendezvous --metrics_port` and `--metrics_addr`). While the built binary lacks one, it is reported, not
# failed; once the binary has it, it is checked like every other flag.
PENDING_FLAGS = {("ddp-rendezvous", "--metrics_port"): "the Prometheus metrics",
                 ("ddp-rendezvous", "--metrics_addr"): "the Prometheus metrics"}
_noted = set()

# ---- the schemas ------------------------------------------------------------------------------

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
PORT_NAME = r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # IANA_SVC_NAME
C_IDENTIFIER = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"  # env var names kubectl accepts


def obj(properties, required=()):
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


STRING = {"type": "string"}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
STRINGS = {"type": "array", "items": STRING}
PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
INT_OR_STRING = {"anyOf": [PORT, {"type": "string", "pattern": PORT_NAME}]}
QUANTITY = {"anyOf": [{"type": "string", "pattern": r"^[0-9.]+([eE][0-9]+|[a-zA-Z]{1,2})?$"}, {"type": "number"}]}

DEFINITIONS = {
    "ObjectMeta": obj({
        "name": {"type": "string", "pattern": DNS_SUBDOMAIN, "maxLength": 253},
        "namespace": {"type": "string", "pattern": DNS_LABEL},
        "labels": STRING_MAP, "annotations": STRING_MAP}),
    "LabelSelector": obj({"matchLabels": STRING_MAP, "matchExpressions": {"type": "array"}}),
    "EnvVar": obj({
        "name": {"type": "string", "pattern": C_IDENTIFIER}, "value": STRING,
        "valueFrom": obj({
            "fieldRef": obj({"fieldPath": STRING, "apiVersion": STRING}, ["fieldPath"]),
            "secretKeyRef": obj({"name": STRING, "key": STRING, "optional": BOOL}, ["key"]),
            "configMapKeyRef": obj({"name": STRING, "key": STRING, "optional": BOOL}, ["key"]),
            "resourceFieldRef": obj({"resource": STRING, "containerName": STRING, "divisor": QUANTITY},
                                    ["resource"])})},
        ["name"]),
    "ContainerPort": obj({
        "name": {"type": "string", "pattern": PORT_NAME}, "containerPort": PORT, "hostPort": PORT,
        "hostIP": STRING, "protocol": {"enum": ["TCP", "UDP", "SCTP"]}}, ["containerPort"]),
    "Probe": obj({
        "httpGet": obj({"path": STRING, "port": INT_OR_STRING, "host": STRING,
                        "scheme": {"enum": ["HTTP", "HTTPS"]}, "httpHeaders": {"type": "array"}}, ["port"]),
        "tcpSocket": obj({"port": INT_OR_STRING, "host": STRING}, ["port"]),
        "exec": obj({"command": STRINGS}),
        "grpc": obj({"port": PORT, "service": STRING}, ["port"]),
        "initialDelaySeconds": {"type": "integer", "minimum": 0},
        "periodSeconds": {"type": "integer", "minimum": 1},
        "timeoutSeconds": {"type": "integer", "minimum": 1},
        "successThreshold": {"type": "integer", "minimum": 1},
        "failureThreshold": {"type": "integer", "minimum": 1},
        "terminationGracePeriodSeconds": INT}),
    "ResourceRequirements": obj({"limits": {"type": "object", "additionalProperties": QUANTITY},
                                 "requests": {"type": "object", "additionalProperties": QUANTITY}}),
    "VolumeMount": obj({"name": STRING, "mountPath": STRING, "readOnly": BOOL, "subPath": STRING},
                       ["name", "mountPath"]),
    "SecurityContext": obj({
        "allowPrivilegeEscalation": BOOL, "readOnlyRootFilesystem": BOOL, "privileged": BOOL,
        "runAsNonRoot": BOOL, "runAsUser": INT, "runAsGroup": INT,
        "capabilities": obj({"add": STRINGS, "drop": STRINGS}),
        "seccompProfile": obj({"type": {"enum": ["RuntimeDefault", "Localhost", "Unconfined"]},
                               "localhostProfile": STRING}, ["type"])}),
    "PodSecurityContext": obj({
        "runAsNonRoot": BOOL, "runAsUser": INT, "runAsGroup": INT, "fsGroup": INT,
        "supplementalGroups": {"type": "array", "items": INT},
        "seccompProfile": obj({"type": {"enum": ["RuntimeDefault", "Localhost", "Unconfined"]},
                               "localhostProfile": STRING}, ["type"])}),
    "Container": obj({
        "name": {"type": "string", "pattern": DNS_LABEL}, "image": STRING,
        "imagePullPolicy": {"enum": ["Always", "Never", "IfNotPresent"]},
        "command": STRINGS, "args": STRINGS, "workingDir": STRING,
        "env": {"type": "array", "items": {"$ref": "#/definitions/EnvVar"}},
        "ports": {"type": "array", "items": {"$ref": "#/definitions/ContainerPort"}},
        "livenessProbe": {"$ref": "#/definitions/Probe"},
        "readinessProbe": {"$ref": "#/definitions/Probe"},
        "startupProbe": {"$ref": "#/definitions/Probe"},
        "resources": {"$ref": "#/definitions/ResourceRequirements"},
        "volumeMounts": {"type": "array", "items": {"$ref": "#/definitions/VolumeMount"}},
        "securityContext": {"$ref": "#/definitions/SecurityContext"}},
        ["name", "image"]),
    "Volume": obj({
        "name": {"type": "string", "pattern": DNS_LABEL},
        "secret": obj({"secretName": STRING, "defaultMode": {"type": "integer", "minimum": 0, "maximum": 511},
                       "optional": BOOL, "items": {"type": "array"}}),
        "configMap": obj({"name": STRING, "defaultMode": INT, "items": {"type": "array"}}),
        "emptyDir": obj({"medium": {"enum": ["", "Memory"]}, "sizeLimit": QUANTITY}),
        "persistentVolumeClaim": obj({"claimName": STRING, "readOnly": BOOL}, ["claimName"])},
        ["name"]),
    "PodSpec": obj({
        "containers": {"type": "array", "minItems": 1, "items": {"$ref": "#/definitions/Container"}},
        "initContainers": {"type": "array", "items": {"$ref": "#/definitions/Container"}},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
        "terminationGracePeriodSeconds": {"type": "integer", "minimum": 0},
        "volumes": {"type": "array", "items": {"$ref": "#/definitions/Volume"}},
        "securityContext": {"$ref": "#/definitions/PodSecurityContext"},
        "serviceAccountName": STRING, "nodeSelector": STRING_MAP, "tolerations": {"type": "array"},
        "affinity": {"type": "object"}, "hostname": STRING, "subdomain": STRING,
        "priorityClassName": STRING},
        ["containers"]),
    "PodTemplateSpec": obj({"metadata": {"$ref": "#/definitions/ObjectMeta"},
                            "spec": {"$ref": "#/definitions/PodSpec"}}, ["spec"]),
    "ReplicaSpec": obj({  # Kubeflow's common ReplicaSpec
        "replicas": {"type": "integer", "minimum": 0},
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {"$ref": "#/definitions/PodTemplateSpec"}}, ["template"]),
}


def top(api_version, kind, spec):
    schema = obj({"apiVersion": {"const": api_version}, "kind": {"const": kind},
                  "metadata": {"$ref": "#/definitions/ObjectMeta"}, "spec": spec},
                 ["apiVersion", "kind", "metadata", "spec"])
    schema["definitions"] = DEFINITIONS
    schema["properties"]["metadata"] = {"allOf": [{"$ref": "#/definitions/ObjectMeta"}, {"required": ["name"]}]}
    return schema


SCHEMAS = {
    ("apps/v1", "Deployment"): top("apps/v1", "Deployment", obj({
        "replicas": {"type": "integer", "minimum": 0},
        "selector": {"$ref": "#/definitions/LabelSelector"},
        "strategy": obj({"type": {"enum": ["Recreate", "RollingUpdate"]}, "rollingUpdate": {"type": "object"}}),
        "template": {"$ref": "#/definitions/PodTemplateSpec"},
        "minReadySeconds": INT, "revisionHistoryLimit": INT, "progressDeadlineSeconds": INT},
        ["selector", "template"])),
    ("v1", "Service"): top("v1", "Service", obj({
        "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
        "selector": STRING_MAP, "clusterIP": STRING, "publishNotReadyAddresses": BOOL,
        "ports": {"type": "array", "minItems": 1, "items": obj({
            "name": {"type": "string", "pattern": DNS_LABEL}, "port": PORT, "targetPort": INT_OR_STRING,
            "nodePort": PORT, "protocol": {"enum": ["TCP", "UDP", "SCTP"]}, "appProtocol": STRING},
            ["port"])}})),
    ("batch/v1", "Job"): top("batch/v1", "Job", obj({
        "completionMode": {"enum": ["NonIndexed", "Indexed"]},
        "completions": {"type": "integer", "minimum": 0},
        "parallelism": {"type": "integer", "minimum": 0},
        "backoffLimit": {"type": "integer", "minimum": 0},
        "backoffLimitPerIndex": {"type": "integer", "minimum": 0},
        "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
        "podFailurePolicy": {"type": "object"},
        "template": {"allOf": [{"$ref": "#/definitions/PodTemplateSpec"},
                               # A Job's pods must not restart in place forever.
                               {"properties": {"spec": {"properties": {"restartPolicy": {
                                   "enum": ["Never", "OnFailure"]}}, "required": ["restartPolicy"]}}}]}},
        ["template"])),
    ("kubeflow.org/v1", "PyTorchJob"): top("kubeflow.org/v1", "PyTorchJob", obj({
        "nprocPerNode": {"type": "string", "pattern": r"^([0-9]+|auto|cpu|gpu)$"},
        "elasticPolicy": obj({
            "minReplicas": {"type": "integer", "minimum": 1}, "maxReplicas": {"type": "integer", "minimum": 1},
            "rdzvBackend": {"enum": ["c10d", "etcd", "etcd-v2", "static"]},
            "rdzvHost": STRING, "rdzvPort": PORT, "rdzvId": STRING,
            "rdzvConf": {"type": "array", "items": obj({"key": STRING, "value": STRING})},
            "standalone": BOOL, "nProcPerNode": INT, "maxRestarts": {"type": "integer", "minimum": 0},
            "metrics": {"type": "array"}}),
        "runPolicy": obj({"cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                          "backoffLimit": INT, "activeDeadlineSeconds": INT, "ttlSecondsAfterFinished": INT,
                          "suspend": BOOL, "schedulingPolicy": {"type": "object"}}),
        "pytorchReplicaSpecs": obj({"Master": {"$ref": "#/definitions/ReplicaSpec"},
                                    "Worker": {"$ref": "#/definitions/ReplicaSpec"}})},
        ["pytorchReplicaSpecs"])),
}

# ---- the checks -------------------------------------------------------------------------------


def help_text(program):
    r = subprocess.run([BINARIES[program], "--help"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise AssertionError("%s --help exited %d: %s" % (program, r.returncode, r.stderr))
    return r.stdout


def has_flag(help_text_, flag):
    return re.search(r"(^|[\s,])%s([\s,=]|$)" % re.escape(flag), help_text_, re.M) is not None


def pod_specs(doc):
    """(where, PodSpec) of every pod template in a document."""
    spec = doc.get("spec", {})
    if "template" in spec:
        yield doc["kind"], spec["template"]["spec"], spec["template"].get("metadata", {})
    for role, replica in spec.get("pytorchReplicaSpecs", {}).items():
        yield "%s %s" % (doc["kind"], role), replica["template"]["spec"], replica["template"].get("metadata", {})


def problems(docs, helps):
    """Every way the documents fail: a list of texts (empty = valid). `helps` maps a program to
    its --help text (None: not built)."""
    out = []
    by_kind = {}
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        name = "%s/%s" % (key[1], doc.get("metadata", {}).get("name"))
        schema = SCHEMAS.get(key)
        if schema is None:
            out.append("%s: no schema for apiVersion %s kind %s" % (name, key[0], key[1]))
            continue
        for error in sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=str):
            out.append("%s: %s: %s" % (name, "/".join(map(str, error.absolute_path)), error.message))
        by_kind.setdefault(key[1], []).append(doc)
    if out:
        return out  # the cross-checks below assume well-formed documents

    for doc in docs:
        name = "%s/%s" % (doc["kind"], doc["metadata"]["name"])
        if doc["kind"] == "Deployment":
            labels = doc["spec"]["template"].get("metadata", {}).get("labels", {})
            for k, v in doc["spec"]["selector"].get("matchLabels", {}).items():
                if labels.get(k) != v:
                    out.append("%s: selector %s=%s does not match the pod labels %s" % (name, k, v, labels))
        if doc["kind"] == "Job" and doc["spec"].get("completionMode") == "Indexed":
            if doc["spec"].get("completions") != doc["spec"].get("parallelism"):
                out.append("%s: an indexed training Job runs every node at once: completions must "
                           "equal parallelism" % name)
        if doc["kind"] == "PyTorchJob":
            for role, replica in doc["spec"]["pytorchReplicaSpecs"].items():
                if not any(c["name"] == "pytorch" for c in replica["template"]["spec"]["containers"]):
                    out.append("%s %s: Kubeflow needs a container named 'pytorch'" % (name, role))
            ep = doc["spec"].get("elasticPolicy", {})
            if ep.get("minReplicas", 1) > ep.get("maxReplicas", ep.get("minReplicas", 1)):
                out.append("%s: elasticPolicy minReplicas exceeds maxReplicas" % name)
        for where, pod, meta in pod_specs(doc):
            out += container_problems("%s/%s (%s)" % (doc["kind"], doc["metadata"]["name"], where), pod, helps)

    services = {s["metadata"]["name"]: s for s in by_kind.get("Service", [])}
    for svc in services.values():
        targets = [d for d in by_kind.get("Deployment", [])
                   if all(d["spec"]["template"].get("metadata", {}).get("labels", {}).get(k) == v
                          for k, v in svc["spec"].get("selector", {}).items())]
        if not targets:
            out.append("Service/%s: its selector matches no Deployment's pods" % svc["metadata"]["name"])
        for d in targets:
            names = {p.get("name") for c in d["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                if isinstance(target, str) and target not in names:
                    out.append("Service/%s: targetPort %s is no port of Deployment/%s (%s)"
                               % (svc["metadata"]["name"], target, d["metadata"]["name"], sorted(names)))
    return out


def container_problems(where, pod, helps):
    out = []
    volumes = {v["name"] for v in pod.get("volumes", [])}
    for c in pod["containers"]:
        here = "%s container %s" % (where, c["name"])
        ports = {p.get("name"): p for p in c.get("ports", [])}
        for m in c.get("volumeMounts", []):
            if m["name"] not in volumes:
                out.append("%s: volumeMount %s names no volume" % (here, m["name"]))
        for probe_name, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            probe = c.get(probe_name)
            if probe is None:
                continue
            get = probe.get("httpGet")
            if get is None or get.get("port") != "metrics" or get.get("path") != path:
                out.append("%s: %s must be httpGet %s on the port named 'metrics'" % (here, probe_name, path))
            elif "metrics" not in ports:
                out.append("%s: %s uses port 'metrics', which the container does not declare" % (here, probe_name))
        argv = list(c.get("command", [])) + list(c.get("args", []))
        if not argv:
            continue
        program = os.path.basename(argv[0])
        if program in BINARIES:
            out += flag_problems(here, program, argv[1:], helps.get(program))
            env_names = [e["name"] for e in c.get("env", [])]
            if program == "ddplaunch" and helps.get("ddplaunch") is not None:
                for var in env_names:
                    if var.startswith("PET_") and ("Env: %s." % var) not in helps["ddplaunch"]:
                        out.append("%s: %s is no PET_ variable of ddplaunch" % (here, var))
            if program == "ddp-rendezvous" and "rendezvous" not in ports:
                out.append("%s: the daemon's port must be named 'rendezvous'" % here)
        defined = {e["name"] for e in c.get("env", [])}
        for word in argv:
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", word):
                if ref not in defined:
                    out.append("%s: $(%s) is not defined in the container's env" % (here, ref))
    return out


def flag_problems(where, program, args, help_):
    """Flags up to the program ddplaunch runs (its own arguments are not ours to check)."""
    out = []
    for arg in args:
        if not arg.startswith("-"):
            break  # PROGRAM: the rest belongs to it
        flag = arg.split("=", 1)[0]
        if help_ is None:
            out.append("%s: %s is not built, cannot check %s" % (where, program, flag))
        elif not has_flag(help_, flag):
            if (program, flag) in PENDING_FLAGS:
                if (program, flag) in _noted:
                    continue
                _noted.add((program, flag))
                print("\n[kubernetes] note: %s %s is not in this build yet (%s); not checked"
                      % (program, flag, PENDING_FLAGS[(program, flag)]), file=sys.stderr)
            else:
                out.append("%s: %s has no flag %s" % (where, program, flag))
    return out


def load(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


class KubernetesManifestsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.helps = {}
        for program, path in BINARIES.items():
            if not os.path.exists(path):
                raise AssertionError("not built: %s" % path)
            cls.helps[program] = help_text(program)
        cls.files = sorted(glob.glob(os.path.join(EXAMPLES, "*.yaml")))
        cls.docs = [d for f in cls.files for d in load(f)]

    def test_the_examples_are_all_there(self):
        names = sorted(os.path.basename(f) for f in self.files)
        self.assertEqual(names, ["indexed-job.yaml", "pytorchjob.yaml", "rendezvous.yaml"])
        kinds = sorted(d["kind"] for d in self.docs)
        self.assertEqual(kinds, ["Deployment", "Job", "PyTorchJob", "Service"])

    def test_every_manifest_is_valid_and_consistent(self):
        self.assertEqual(problems(self.docs, self.helps), [])

    def test_jobs_reach_the_rendezvous_through_the_service(self):
        svc = next(d for d in self.docs if d["kind"] == "Service")
        port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "rendezvous")
        endpoint = "%s:%d" % (svc["metadata"]["name"], port)
        job = next(d for d in self.docs if d["kind"] == "Job")
        env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        self.assertEqual(env["PET_RDZV_ENDPOINT"]["value"], endpoint)
        self.assertEqual(env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"],
                         "metadata.annotations['batch.kubernetes.io/job-completion-index']")
        self.assertEqual(env["PET_NNODES"]["value"], str(job["spec"]["completions"]))
        ptj = next(d for d in self.docs if d["kind"] == "PyTorchJob")
        ep = ptj["spec"]["elasticPolicy"]
        self.assertEqual("%s:%d" % (ep["rdzvHost"], ep["rdzvPort"]), endpoint)
        self.assertEqual(ep["rdzvBackend"], "c10d")

    def test_the_checks_catch_what_they_are_for(self):
        def broken(change):
            docs = copy.deepcopy(self.docs)
            change({d["kind"]: d for d in docs})
            return "\n".join(problems(docs, self.helps))

        def container(kind):
            return lambda docs: (docs[kind]["spec"]["template"]["spec"]["containers"][0]
                                 if kind != "PyTorchJob" else
                                 docs[kind]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0])

        deployment, job, ptj = container("Deployment"), container("Job"), container("PyTorchJob")
        cases = [
            (lambda d: deployment(d).update(imagePullPolicy="Sometimes"), "is not one of"),
            (lambda d: deployment(d).update(livenessProbes={}), "Additional properties are not allowed"),
            (lambda d: deployment(d)["ports"][0].update(containerPort="29400"), "is not of type 'integer'"),
            (lambda d: deployment(d).pop("image"), "'image' is a required property"),
            (lambda d: d["Deployment"]["spec"].pop("selector"), "'selector' is a required property"),
            (lambda d: d["Deployment"].update(apiVersion="apps/v1beta1"), "no schema for apiVersion"),
            (lambda d: d["Job"]["spec"]["template"]["spec"].update(restartPolicy="Always"), "is not one of"),
            (lambda d: d["Job"]["spec"].update(completionMode="indexed"), "is not one of"),
            (lambda d: d["Service"]["spec"]["ports"][0].update(targetPort="rdzv"), "targetPort rdzv is no port"),
            (lambda d: d["Deployment"]["spec"]["template"]["metadata"]["labels"].update(
                {"app.kubernetes.io/name": "other"}), "selector app.kubernetes.io/name=ddp-rendezvous"),
            (lambda d: deployment(d)["readinessProbe"]["httpGet"].update(path="/ready"), "readinessProbe must be"),
            (lambda d: deployment(d)["args"].append("--prot=29400"), "ddp-rendezvous has no flag --prot"),
            (lambda d: job(d)["args"].insert(0, "--maxrestarts=3"), "ddplaunch has no flag --maxrestarts"),
            (lambda d: job(d)["env"].append({"name": "PET_NNODE", "value": "2"}), "PET_NNODE is no PET_ variable"),
            (lambda d: job(d)["args"].insert(0, "--rdzv_conf=$(CONF)"), "$(CONF) is not defined"),
            (lambda d: ptj(d).update(name="trainer"), "container named 'pytorch'"),
            (lambda d: d["PyTorchJob"]["spec"]["elasticPolicy"].update(rdzvBackend="ddp"), "is not one of"),
            (lambda d: d["PyTorchJob"]["spec"].update(nprocPerNode=4), "is not of type 'string'"),
        ]
        for change, expected in cases:
            with self.subTest(expected=expected):
                self.assertIn(expected, broken(change))
        # An argument after PROGRAM belongs to the training program, not to ddplaunch.
        self.assertEqual(broken(lambda d: job(d)["args"].append("--not-a-ddplaunch-flag")), "")


if __name__ == "__main__":
    unittest.main()
