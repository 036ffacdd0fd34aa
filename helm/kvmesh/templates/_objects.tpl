{{/* The small per-component objects: metrics Service, PodDisruptionBudget, HPA. */}}

{{- define "kvmesh.metricsService" -}}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "kvmesh.fullname" .root }}-{{ .component }}-metrics
  labels:
    {{- include "kvmesh.labels" . | nindent 4 }}
    kvmesh.io/metrics: "true"
spec:
  type: ClusterIP
  selector:
    {{- include "kvmesh.selectorLabels" . | nindent 4 }}
  ports:
    - name: metrics
      port: {{ .root.Values.settings.sidePort }}
      targetPort: metrics
{{- end }}

{{- define "kvmesh.pdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kvmesh.fullname" .root }}-{{ .component }}
  labels:
    {{- include "kvmesh.labels" . | nindent 4 }}
spec:
  maxUnavailable: {{ .values.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "kvmesh.selectorLabels" . | nindent 6 }}
{{- end }}

{{- define "kvmesh.hpa" -}}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "kvmesh.fullname" .root }}-{{ .component }}
  labels:
    {{- include "kvmesh.labels" . | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "kvmesh.fullname" .root }}-{{ .component }}
  minReplicas: {{ .values.autoscaling.minReplicas }}
  maxReplicas: {{ .values.autoscaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ .values.autoscaling.targetCPUUtilizationPercentage }}
{{- end }}
