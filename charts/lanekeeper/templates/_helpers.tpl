{{/* Name of the chart, or nameOverride. */}}
{{- define "lanekeeper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name, at most 63 characters less room for a suffix. */}}
{{- define "lanekeeper.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "lanekeeper.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "lanekeeper.labels" -}}
helm.sh/chart: {{ include "lanekeeper.chart" . }}
app.kubernetes.io/name: {{ include "lanekeeper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lanekeeper
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component: include with (dict "ctx" $ "component" "controller"). */}}
{{- define "lanekeeper.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lanekeeper.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "lanekeeper.controllerName" -}}
{{- printf "%s-controller" (include "lanekeeper.fullname" .) }}
{{- end }}

{{- define "lanekeeper.ingestName" -}}
{{- printf "%s-ingest" (include "lanekeeper.fullname" .) }}
{{- end }}

{{- define "lanekeeper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "lanekeeper.controllerName" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image reference: repository@digest, or repository:tag (default appVersion). */}}
{{- define "lanekeeper.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* "true" when the controller elects a leader: leaderElection.enabled, or auto and replicaCount > 1. */}}
{{- define "lanekeeper.leaderElection" -}}
{{- $le := .Values.controller.leaderElection.enabled }}
{{- if eq (toString $le) "auto" }}
{{- ternary "true" "false" (gt (int .Values.controller.replicaCount) 1) }}
{{- else if eq (toString $le) "true" }}
{{- "true" }}
{{- else if eq (toString $le) "false" }}
{{- if gt (int .Values.controller.replicaCount) 1 }}
{{- fail "controller.leaderElection.enabled=false needs controller.replicaCount=1: two controllers would both write" }}
{{- end }}
{{- "false" }}
{{- else }}
{{- fail (printf "controller.leaderElection.enabled must be auto, true or false, not %v" $le) }}
{{- end }}
{{- end }}

{{/* Secret names the controller may read (Redis credentials). */}}
{{- define "lanekeeper.redisSecretNames" -}}
{{- $names := list }}
{{- with .Values.redis.secretName }}{{ $names = append $names . }}{{ end }}
{{- range .Values.redis.extraSecretNames }}{{ $names = append $names . }}{{ end }}
{{- with .Values.redis.tls.caSecretName }}{{ $names = append $names . }}{{ end }}
{{- with .Values.redis.tls.clientCertSecretName }}{{ $names = append $names . }}{{ end }}
{{- toJson ($names | uniq) }}
{{- end }}

{{/* NetworkPolicy egress rules every pod needs: DNS and Redis. Include with .Values.networkPolicy. */}}
{{- define "lanekeeper.egressDNSandRedis" -}}
# DNS
- ports:
    - {port: 53, protocol: UDP}
    - {port: 53, protocol: TCP}
# Redis
- ports:
    {{- range .redis.ports }}
    - {port: {{ . }}, protocol: TCP}
    {{- end }}
  {{- with .redis.to }}
  to:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
