{{/*
The Deployment of one kvmesh service. Every component runs the same image as
`python -m kvmesh.services.<module>`; an init container declares the JetStream
streams first (create-or-update, idempotent) because the runner only binds
consumers; it connects as NATS's admin user, the service container as its
own role's user (component name = role, shared/bus/permissions.py). Probes
hit the runner's side port: /healthz (alive), /readyz (NATS connected,
consumers bound, service check).
*/}}
{{- define "kvmesh.deployment" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $gpu := and (hasKey $v "gpu") $v.gpu.enabled }}
{{- $resources := deepCopy ($v.resources | default dict) }}
{{- if $gpu }}
{{- $_ := set $resources "limits" (merge (dict "nvidia.com/gpu" $v.gpu.count) ($resources.limits | default dict)) }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "kvmesh.fullname" $root }}-{{ .component }}
  labels:
    {{- include "kvmesh.labels" . | nindent 4 }}
spec:
  {{- if not (and (hasKey $v "autoscaling") $v.autoscaling.enabled) }}
  replicas: {{ $v.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "kvmesh.selectorLabels" . | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "kvmesh.labels" . | nindent 8 }}
        {{- include "kvmesh.clientLabels" . | nindent 8 }}
      annotations:
        {{- include "kvmesh.configChecksum" $root | nindent 8 }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      # Longer than the runner's drain (service.drain_timeout_s) so in-flight work finishes.
      terminationGracePeriodSeconds: 30
      initContainers:
        - name: declare-streams
          image: {{ include "kvmesh.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["python", "deploy/declare_streams.py"]
          envFrom:
            - configMapRef:
                name: {{ include "kvmesh.fullname" $root }}-config
          {{- if or $root.Values.nats.auth.enabled $root.Values.nats.tls.enabled }}
          env:
            {{- include "kvmesh.natsClientEnv" (dict "root" $root "role" "admin") | nindent 12 }}
          {{- end }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          {{- if $root.Values.nats.tls.enabled }}
          volumeMounts:
            - {name: nats-tls, mountPath: /etc/kvmesh/nats-tls, readOnly: true}
          {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "kvmesh.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["python", "-m", "kvmesh.services.{{ .module }}"]
          ports:
            - name: metrics
              containerPort: {{ $root.Values.settings.sidePort }}
            {{- if eq .module "ingress" }}
            - name: http
              containerPort: {{ $v.port }}
            {{- end }}
          envFrom:
            - configMapRef:
                name: {{ include "kvmesh.fullname" $root }}-config
          env:
            - name: KVMESH_SERVICE__WORKER_ID
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            {{- include "kvmesh.s3Env" $root | nindent 12 }}
            {{- include "kvmesh.natsClientEnv" (dict "root" $root "role" .component) | nindent 12 }}
            {{- if eq .module "ingress" }}
            - name: KVMESH_API_KEYS
              valueFrom:
                secretKeyRef: {name: {{ include "kvmesh.apiKeysSecret" $root }}, key: {{ $root.Values.apiKeys.secretKey }}}
            - name: KVMESH_INGRESS__PORT
              value: {{ $v.port | quote }}
            - name: KVMESH_INGRESS__SECRET_FILE
              value: /etc/kvmesh/ingress-secret/secret
            {{- end }}
            {{- if $gpu }}
            - name: KVMESH_ENGINE__DEVICE
              value: cuda
            {{- end }}
          startupProbe:
            httpGet: {path: /healthz, port: metrics}
            periodSeconds: 5
            failureThreshold: 60
          livenessProbe:
            httpGet: {path: /healthz, port: metrics}
            periodSeconds: 10
            failureThreshold: 3
          readinessProbe:
            httpGet: {path: /readyz, port: metrics}
            periodSeconds: 5
            failureThreshold: 2
          resources:
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          volumeMounts:
            - name: state
              mountPath: /var/lib/kvmesh
            {{- if $root.Values.model.existingClaim }}
            - name: model
              mountPath: {{ $root.Values.model.mountPath }}
              readOnly: true
            {{- end }}
            {{- if hasKey $v "shmSize" }}
            - name: shm
              mountPath: /dev/shm
            {{- end }}
            {{- if eq .module "ingress" }}
            - name: ingress-secret
              mountPath: /etc/kvmesh/ingress-secret
              readOnly: true
            {{- end }}
            {{- if $root.Values.nats.tls.enabled }}
            - {name: nats-tls, mountPath: /etc/kvmesh/nats-tls, readOnly: true}
            {{- end }}
      volumes:
        - name: state
          emptyDir: {}
        {{- if eq .module "ingress" }}
        # One salt secret for every replica (never a per-pod file): same tenant, same block hashes.
        - name: ingress-secret
          secret:
            secretName: {{ include "kvmesh.ingressSecretName" $root }}
            items:
              - {key: {{ $root.Values.ingressSecret.secretKey }}, path: secret}
            defaultMode: 0440
        {{- end }}
        {{- if $root.Values.nats.tls.enabled }}
        # Only the CA: clients verify the server; the server's key stays in the NATS pods.
        - name: nats-tls
          secret:
            secretName: {{ required "nats.tls.secretName is required with nats.tls.enabled" $root.Values.nats.tls.secretName }}
            items:
              - {key: ca.crt, path: ca.crt}
        {{- end }}
        {{- if $root.Values.model.existingClaim }}
        - name: model
          persistentVolumeClaim:
            claimName: {{ $root.Values.model.existingClaim }}
            readOnly: true
        {{- end }}
        {{- if hasKey $v "shmSize" }}
        # The L2 host tier lives in POSIX shared memory; the runtime's default /dev/shm is far too small.
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $v.shmSize }}
        {{- end }}
      {{- include "kvmesh.scheduling" $v | nindent 6 }}
{{- end }}
