{{/*
Names, labels and the settings every kvmesh pod shares. Component templates
pass a context dict: {root: ., component: "prefill", values: .Values.prefill,
module: "prefill"} (component = Kubernetes name, module = services.<module>).
*/}}

{{- define "kvmesh.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvmesh.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Standard labels; call with (dict "root" . "component" "prefill"). */}}
{{- define "kvmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "kvmesh.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvmesh
{{- end }}

{{- define "kvmesh.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmesh.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Pods carrying this label may reach NATS and MinIO (networkpolicy-*.yaml). */}}
{{- define "kvmesh.clientLabels" -}}
kvmesh.io/client: "true"
{{- end }}

{{- define "kvmesh.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion }}
{{- printf "%s:%s" (required "image.repository is required" .Values.image.repository) $tag }}
{{- end }}

{{- define "kvmesh.natsUrl" -}}
{{- if .Values.nats.deploy }}
{{- printf "nats://%s-nats:4222" (include "kvmesh.fullname" .) }}
{{- else }}
{{- required "nats.url is required when nats.deploy is false" .Values.nats.url }}
{{- end }}
{{- end }}

{{- define "kvmesh.s3Endpoint" -}}
{{- if .Values.minio.deploy }}
{{- printf "%s-minio:9000" (include "kvmesh.fullname" .) }}
{{- else }}
{{- required "minio.endpoint (host:port) is required when minio.deploy is false" .Values.minio.endpoint }}
{{- end }}
{{- end }}

{{- define "kvmesh.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-secrets" (include "kvmesh.fullname" .)) }}
{{- end }}

{{- define "kvmesh.s3Secret" -}}
{{- .Values.s3.existingSecret | default (printf "%s-secrets" (include "kvmesh.fullname" .)) }}
{{- end }}

{{/* Credentials from the Secret(s); every service and MinIO read them this way. */}}
{{- define "kvmesh.s3Env" -}}
- name: KVMESH_S3_ACCESS_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "kvmesh.s3Secret" . }}, key: {{ .Values.s3.accessKeyKey }}}
- name: KVMESH_S3_SECRET_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "kvmesh.s3Secret" . }}, key: {{ .Values.s3.secretKeyKey }}}
{{- end }}

{{- define "kvmesh.configChecksum" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secret: {{ include (print .Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}

{{- define "kvmesh.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
