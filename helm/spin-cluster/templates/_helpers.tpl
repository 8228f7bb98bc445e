{{/* Names: at most 47 characters, KubeRay's limit for a RayService name. */}}
{{- define "spin-cluster.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 47 | trimSuffix "-" }}
{{- end }}

{{- define "spin-cluster.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else if contains (include "spin-cluster.name" .) .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "spin-cluster.name" .) | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "spin-cluster.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spin-cluster.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "spin-cluster.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "spin-cluster.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "spin-cluster.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "spin-cluster.modelPath" -}}
{{ trimSuffix "/" .Values.model.mountPath }}/{{ .Values.model.folder }}
{{- end }}

{{/*
The Serve deploy config (serveConfigV2): the structure of
spin_cluster.deployments.app.deploy_config(args), whose args name the app config bundled in
the image, as local mode does, plus the keys the Kubernetes shape decides.
*/}}
{{- define "spin-cluster.serveConfig" -}}
{{- range $key, $from := dict "model.path" "model.mountPath and model.folder" "serve.num_engine_replicas" "workers.replicas" "serve.engine_num_gpus" "workers.gpusPerPod" "serve.model_name" "model.servedName" "serve.hplb_profile" "hplb.profile" }}
{{- $parts := splitList "." $key }}
{{- if hasKey (index $.Values.app.overrides (first $parts) | default dict) (last $parts) }}
{{- fail (printf "app.overrides.%s is set by the chart from %s; remove it from app.overrides" $key $from) }}
{{- end }}
{{- end }}
{{- $shape := dict
      "model" (dict "path" (include "spin-cluster.modelPath" .))
      "serve" (dict "num_engine_replicas" .Values.workers.replicas "engine_num_gpus" .Values.workers.gpusPerPod) }}
{{- with .Values.model.servedName }}
{{- $_ := set $shape.serve "model_name" . }}
{{- end }}
{{- if .Values.hplb.profile }}
{{- $_ := set $shape.serve "hplb_profile" (printf "%s/profile.json" .Values.hplb.mountPath) }}
{{- end }}
{{- $args := mergeOverwrite (deepCopy .Values.app.overrides) $shape }}
{{- $_ := set $args "config" .Values.app.config }}
{{- $app := dict "name" .Values.app.name "route_prefix" .Values.app.routePrefix
      "import_path" "spin_cluster.deployments.app:build_app" "args" $args }}
{{- toYaml (dict
      "proxy_location" "EveryNode"
      "http_options" (dict "host" "0.0.0.0" "port" 8000)
      "applications" (list $app)) }}
{{- end }}

{{/*
The app's serve.drain_s: app.overrides' or the app's default (ServeOptions.drain_s, which
tests/helm/test_chart.py holds this to). A SIGTERM to a pod drains Ray's node that long
(RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S) while the replicas' graceful shutdown lets requests
in flight finish; the pod gets 10 s more before the kubelet kills it.
*/}}
{{- define "spin-cluster.drainSeconds" -}}
{{- $serve := index .Values.app.overrides "serve" | default dict }}
{{- if hasKey $serve "drain_s" }}{{ $serve.drain_s }}{{ else }}20{{ end }}
{{- end }}

{{/* `ray start` parameters: KubeRay takes strings only. */}}
{{- define "spin-cluster.rayStartParams" -}}
{{- range $key, $value := . }}
{{ $key }}: {{ $value | toString | quote }}
{{- else }}
{}
{{- end }}
{{- end }}

{{/* Environment of every Ray container. */}}
{{- define "spin-cluster.env" -}}
- name: RAY_USAGE_STATS_ENABLED
  value: "0"
# Ray starts its workers at nice 15; the engine replicas would then yield the CPU to every
# other process of the node (the ingress, the proxy, a sidecar).
- name: RAY_worker_niceness
  value: "0"
# torch backs its large CPU allocations (weights, the KV pool) with transparent huge pages.
- name: THP_MEM_ALLOC_ENABLE
  value: "1"
- name: RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
  value: {{ include "spin-cluster.drainSeconds" . | quote }}
{{- with .Values.apiKey.existingSecret }}
- name: SPIN_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.apiKey.key }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Volumes of every Ray pod; `shmSize` is the group's. */}}
{{- define "spin-cluster.volumes" -}}
- name: models
  {{- if eq .root.Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .root.Values.model.pvc.claimName }}
    readOnly: true
  {{- else }}
  hostPath:
    path: {{ .root.Values.model.hostPath.path }}
    type: Directory
  {{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- if .root.Values.hplb.profile }}
- name: hplb-profile
  configMap:
    name: {{ include "spin-cluster.fullname" .root }}-hplb
{{- end }}
{{- end }}

{{- define "spin-cluster.volumeMounts" -}}
- name: models
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
- name: dshm
  mountPath: /dev/shm
{{- if .Values.hplb.profile }}
- name: hplb-profile
  mountPath: {{ .Values.hplb.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
One Ray pod template; dict keys: root (the top context), component (head, worker),
group (.Values.head or .Values.workers), ports (container ports), gpus (0 for the head).
*/}}
{{- define "spin-cluster.podTemplate" -}}
{{- $root := .root -}}
metadata:
  labels:
    {{- include "spin-cluster.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
    {{- with $root.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- $annotations := deepCopy $root.Values.podAnnotations }}
  {{- with $root.Values.hplb.profile }}
  {{- /* A new profile changes the cluster spec: KubeRay then starts a cluster that reads it. */}}
  {{- $_ := set $annotations "spin-cluster/hplb-profile-sha256" (sha256sum .) }}
  {{- end }}
  {{- with $annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: {{ add 10 (include "spin-cluster.drainSeconds" $root | float64 | ceil | int) }}
  containers:
    - name: ray-{{ .component }}
      image: {{ include "spin-cluster.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      ports:
        {{- toYaml .ports | nindent 8 }}
      env:
        {{- include "spin-cluster.env" $root | nindent 8 }}
      resources:
        {{- $resources := deepCopy .group.resources }}
        {{- if .gpus }}
        {{- $_ := set $resources "limits" (merge (dict $root.Values.workers.gpuResourceName .gpus) ($resources.limits | default dict)) }}
        {{- $_ := set $resources "requests" (merge (dict $root.Values.workers.gpuResourceName .gpus) ($resources.requests | default dict)) }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        {{- include "spin-cluster.volumeMounts" $root | nindent 8 }}
    {{- if and (eq .component "head") $root.Values.deployStatus.enabled }}
    {{- /* The app's deploy state in this container's log (deployments/deploy_watch.py): the
    head container runs `ray start`, and KubeRay deploys the app through Ray's dashboard, so
    a replica that cannot start says why only in Serve's status. */}}
    - name: deploy-status
      image: {{ include "spin-cluster.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: ["spin-cluster", "watch-deploy", "--app", {{ $root.Values.app.name | quote }},
                "--dashboard", "http://127.0.0.1:8265", "--poll-s", {{ $root.Values.deployStatus.pollSeconds | toString | quote }}]
      env:
        {{- include "spin-cluster.env" $root | nindent 8 }}
      resources:
        {{- toYaml $root.Values.deployStatus.resources | nindent 8 }}
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
    {{- end }}
  volumes:
    {{- include "spin-cluster.volumes" (dict "root" $root "shmSize" .group.shmSize) | nindent 4 }}
  {{- with .group.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .group.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
