{{/*
Expand the name of the chart.
*/}}
{{- define "batchtune.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
A default fully qualified app name, truncated at 63 characters (some name fields are limited to that).
If the release name contains the chart name it is used as the full name.
*/}}
{{- define "batchtune.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version as used by the chart label.
*/}}
{{- define "batchtune.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels.
*/}}
{{- define "batchtune.labels" -}}
helm.sh/chart: {{ include "batchtune.chart" . }}
{{ include "batchtune.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: batchtune
{{- end }}

{{/*
Selector labels.
*/}}
{{- define "batchtune.selectorLabels" -}}
app.kubernetes.io/name: {{ include "batchtune.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The name of the service account to use.
*/}}
{{- define "batchtune.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "batchtune.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The operator image reference; the tag defaults to the chart's appVersion, a digest wins over both.
*/}}
{{- define "batchtune.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
"true" when the operator watches every namespace (watchNamespaces is empty).
*/}}
{{- define "batchtune.clusterWide" -}}
{{- if not .Values.watchNamespaces }}true{{- end }}
{{- end }}

{{/*
RBAC rules the operator needs in every namespace it watches. The cluster-scoped extras (CRD and
namespace discovery, nodes for GPU capacity) are added by rbac.yaml in cluster-wide mode only; Secret
reads are granted by rbac.yaml only in the namespaces of prometheus.authSecretNamespaces.
*/}}
{{- define "batchtune.namespacedRules" -}}
# Framework: kopf watches BatchTunings, keeps its finalizer and progress annotations on them,
# writes their status and posts Events.
- apiGroups: ["batchtune.io"]
  resources: ["batchtunings"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["batchtune.io"]
  resources: ["batchtunings/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# Application: the target Deployment is read and, in Auto mode, patched (container args only);
# trial Deployments and load-generator Jobs are created and deleted; pods are read to classify
# trial failures and find pod IPs; the report ConfigMap is written (create, then replace: never read,
# so no `get` on other ConfigMaps). The admission policy narrows each write (admission-policy.yaml).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "delete", "patch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Application: a trial pod counts only when its ReplicaSet is the trial Deployment's (by uid): one `get` per
# ReplicaSet, never list or watch.
- apiGroups: ["apps"]
  resources: ["replicasets"]
  verbs: ["get"]
# Application: a crashed trial's engine log, for the cause vLLM prints above the termination message's tail.
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Application: Services are read so a trial pod keeps none of the labels they select production by.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["list"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["create", "update"]
{{- end }}

{{/*
The operator's ServiceAccount as the API server names it in request.userInfo.username.
*/}}
{{- define "batchtune.serviceAccountUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "batchtune.serviceAccountName" .) }}
{{- end }}
