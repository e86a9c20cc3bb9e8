// Offline schema validation of the custom resources `sdserve deploy render` emits (Argo Rollouts, KEDA, the
// Prometheus Operator), against the CRD schemas the @kubernetes-models packages ship. Core kinds (Service, PDB,
// Deployment) are validated by the Python tests with kubernetes-validate; this script refuses any other kind.
//
//   node deploy/validate/validate.mjs FILE.yaml...     (or "-" for stdin)
//
// Prints one line per document ("ok KIND NAME" or "INVALID KIND NAME: why") and exits 1 if any document is invalid
// or of a kind it has no schema for.
//
// Unknown fields fail too, as the API server's strict field validation refuses them. The packages' schemas are the
// CRDs' OpenAPI schemas, which are open (no additionalProperties: false): alone they accept `bogus: 1` anywhere. So
// each field is probed: its value is swapped for values of other JSON types and the document validated again. A
// field the schema declares (typed, as every field of these CRDs is) fails at its path for one of them; a field it
// does not declare accepts anything, and is reported as unknown.
import { readFileSync } from "node:fs";
import { parseAllDocuments } from "yaml";
import { Rollout } from "@kubernetes-models/argo-rollouts/argoproj.io/v1alpha1/Rollout";
import { AnalysisTemplate } from "@kubernetes-models/argo-rollouts/argoproj.io/v1alpha1/AnalysisTemplate";
import { ScaledObject } from "@kubernetes-models/keda/keda.sh/v1alpha1/ScaledObject";
import { ServiceMonitor } from "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1/ServiceMonitor";

const MODELS = new Map([
  ["argoproj.io/v1alpha1/Rollout", Rollout],
  ["argoproj.io/v1alpha1/AnalysisTemplate", AnalysisTemplate],
  ["keda.sh/v1alpha1/ScaledObject", ScaledObject],
  ["monitoring.coreos.com/v1/ServiceMonitor", ServiceMonitor],
]);

const escape = (key) => String(key).replaceAll("~", "~0").replaceAll("/", "~1");

function errorsOf(Model, doc) {
  try {
    new Model(doc).validate();
    return [];
  } catch (err) {
    return err.errors ?? [{ instancePath: "", message: String(err.message ?? err) }];
  }
}

// Values of other JSON types than `value`: a declared type, even a union like int-or-string, rejects one of them.
const kind = (v) => (Array.isArray(v) ? "array" : v === null ? "null" : typeof v);
const PROBES = [{ probe: true }, ["probe"], true, 1.5, "probe"];
const others = (value) => PROBES.filter((p) => kind(p) !== kind(value));

// The paths of the fields the schema does not declare (keys of objects, recursively; array items are probed for
// their own keys only).
function unknownFields(Model, doc) {
  const unknown = [];
  const walk = (node, path) => {
    if (Array.isArray(node)) {
      node.forEach((item, i) => walk(item, `${path}/${i}`));
      return;
    }
    if (node === null || typeof node !== "object") return;
    for (const key of Object.keys(node)) {
      const here = `${path}/${escape(key)}`;
      const saved = node[key];
      const caught = others(saved).some((probe) => {
        node[key] = probe;
        return errorsOf(Model, doc).some((e) => e.instancePath === here || e.instancePath.startsWith(`${here}/`));
      });
      node[key] = saved;
      if (!caught) unknown.push(here);
      else walk(saved, here);
    }
  };
  walk(doc, "");
  return unknown;
}

let failed = false;
for (const file of process.argv.slice(2)) {
  const text = readFileSync(file === "-" ? 0 : file, "utf8");
  for (const parsed of parseAllDocuments(text)) {
    if (parsed.errors.length) {
      console.log(`INVALID ${file}: ${parsed.errors[0].message}`);
      failed = true;
      continue;
    }
    const doc = parsed.toJS();
    if (doc === null) continue;
    const what = `${doc.apiVersion}/${doc.kind}`;
    const name = doc.metadata?.name ?? "?";
    const Model = MODELS.get(what);
    if (!Model) {
      console.log(`INVALID ${what} ${name}: no schema here for this kind`);
      failed = true;
      continue;
    }
    const errors = errorsOf(Model, doc);
    const unknown = errors.length ? [] : unknownFields(Model, doc);
    if (errors.length) {
      console.log(`INVALID ${what} ${name}: ${JSON.stringify(errors)}`);
    } else if (unknown.length) {
      console.log(`INVALID ${what} ${name}: unknown field(s) ${unknown.join(", ")}`);
    } else {
      console.log(`ok ${what} ${name}`);
    }
    failed ||= errors.length > 0 || unknown.length > 0;
  }
}
process.exit(failed ? 1 : 0);
